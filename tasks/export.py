"""Task `export`: a Megatron checkpoint -> an HF safetensors directory at `{store}/{run_id}/export/hf`."""

from __future__ import annotations

from typing import Any

from prefect.states import State

from slime.config import Config
from slime.stages.definitions import EXPORT, summarize
from slime.stages.export import run_export
from tasks._cache import StageCachePolicy
from tasks._stage import finish_stage, reused, stage_task, start_stage, with_fields

OUTPUT_NAME = "hf"
CACHE = StageCachePolicy.of(EXPORT, code_modules=("slime.stages.export",))


@stage_task("export", CACHE)
def export(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any] | State:
    """Export `inputs["load"]` to `output`; `inputs["origin_hf_dir"]` (optional) supplies config and tokenizer."""
    run_config = with_fields(config, checkpoint__load=inputs["load"], export__output_dir=output,
                             export__origin_hf_dir=inputs.get("origin_hf_dir"))
    phases, start = start_stage(EXPORT, run_config)
    if start.reused is not None:
        return reused(start)
    with phases.time("export"):
        result = run_export(run_config)
    return finish_stage(start, summarize("export", result, config.run.storage_options), phases)
