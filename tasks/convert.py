"""Task `convert`: the HF checkpoint -> a Megatron checkpoint at `{store}/{run_id}/convert/checkpoint`."""

from __future__ import annotations

from typing import Any

from prefect.states import State

from slime.config import Config
from slime.stages.convert import run_convert
from slime.stages.definitions import CONVERT, summarize
from tasks._cache import StageCachePolicy
from tasks._stage import finish_stage, reused, stage_task, start_stage, with_fields

OUTPUT_NAME = "checkpoint"
CACHE = StageCachePolicy.of(CONVERT, code_modules=("slime.stages.convert",))


@stage_task("convert", CACHE)
def convert(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any] | State:
    """Convert `inputs["hf_checkpoint"]` into `output` (a checkpoint save directory)."""
    run_config = with_fields(config, checkpoint__hf_checkpoint=inputs["hf_checkpoint"], checkpoint__save=output)
    phases, start = start_stage(CONVERT, run_config)
    if start.reused is not None:
        return reused(start)
    with phases.time("convert"):
        result = run_convert(run_config)
    return finish_stage(start, summarize("convert", result, config.run.storage_options), phases)
