"""Task `export`: a Megatron checkpoint -> an HF safetensors directory at `{store}/{run_id}/export/hf`."""

from __future__ import annotations

from typing import Any

from prefect import task

from slime.config import Config
from slime.export import run_export
from tasks._cache import StageCachePolicy
from tasks._stage import Phases, prepare_output, stage_result, with_fields

OUTPUT_NAME = "hf"
# run_export reads only its inputs (checkpoint, optional origin HF dir) and its output location
CONFIG_FIELDS: tuple[str, ...] = ()

CACHE = StageCachePolicy(config_fields=CONFIG_FIELDS, code_modules=("slime.export",))


@task(name="export", task_run_name="export-{run_id}", cache_policy=CACHE, persist_result=True,
      result_serializer="json")
def export(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any]:
    """Export `inputs["load"]` to `output`; `inputs["origin_hf_dir"]` (optional) supplies config and tokenizer."""
    phases = Phases()
    with phases.time("prepare output"):
        prepare_output(output, CACHE.attempt_key(config, inputs, output), config.run.storage_options)
    with phases.time("export"):
        result = run_export(with_fields(config, checkpoint__load=inputs["load"], export__output_dir=output,
                                        export__origin_hf_dir=inputs.get("origin_hf_dir")))
    return stage_result("export", {"hf_model": (result["hf_dir"], result["manifest_hash"])},
                        {"source_checkpoint": result["source_checkpoint"]}, phases)
