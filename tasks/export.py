"""Task `export`: a Megatron checkpoint -> an HF safetensors directory at `{store}/{run_id}/export/hf`."""

from __future__ import annotations

from typing import Any

from slime.config import Config
from slime.stages.export import run_export
from tasks._cache import StageCachePolicy
from tasks._stage import stage_result, stage_task, start_stage, with_fields

OUTPUT_NAME = "hf"
# run_export reads its inputs (checkpoint, optional origin HF dir), its output location and, for a LoRA
# checkpoint, whether to merge the adapters
CONFIG_FIELDS: tuple[str, ...] = ("export.merge",)

CACHE = StageCachePolicy(config_fields=CONFIG_FIELDS, code_modules=("slime.stages.export",))


@stage_task("export", CACHE)
def export(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any]:
    """Export `inputs["load"]` to `output`; `inputs["origin_hf_dir"]` (optional) supplies config and tokenizer."""
    phases = start_stage(CACHE, config, inputs, output)
    with phases.time("export"):
        result = run_export(with_fields(config, checkpoint__load=inputs["load"], export__output_dir=output,
                                        export__origin_hf_dir=inputs.get("origin_hf_dir")))
    return stage_result("export", {"hf_model": (result["hf_dir"], result["manifest_hash"])},
                        {"source_checkpoint": result["source_checkpoint"]}, phases)
