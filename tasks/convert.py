"""Task `convert`: the HF checkpoint -> a Megatron checkpoint at `{store}/{run_id}/convert/checkpoint`."""

from __future__ import annotations

from typing import Any

from slime.config import Config
from slime.stages.convert import run_convert
from tasks._cache import StageCachePolicy
from tasks._stage import stage_result, stage_task, start_stage, with_fields

OUTPUT_NAME = "checkpoint"
# config fields run_convert reads (its input and output locations are task arguments)
CONFIG_FIELDS = ("megatron", "run.seed")

CACHE = StageCachePolicy(config_fields=CONFIG_FIELDS, code_modules=("slime.stages.convert",))


@stage_task("convert", CACHE)
def convert(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any]:
    """Convert `inputs["hf_checkpoint"]` into `output` (a checkpoint save directory)."""
    phases = start_stage(CACHE, config, inputs, output)
    with phases.time("convert"):
        result = run_convert(with_fields(config, checkpoint__hf_checkpoint=inputs["hf_checkpoint"],
                                         checkpoint__save=output))
    return stage_result("convert", {"checkpoint": (result["checkpoint"], result["manifest_hash"])}, {}, phases)
