"""Task `sft`: supervised fine-tuning from a checkpoint into `{store}/{run_id}/sft/checkpoint`."""

from __future__ import annotations

from typing import Any

from prefect.states import State

from slime.config import Config
from slime.stages.definitions import SFT, summarize
from slime.stages.sft import run_sft
from tasks._cache import StageCachePolicy
from tasks._stage import finish_stage, reused, stage_task, start_stage, with_fields

OUTPUT_NAME = "checkpoint"
# keyed on what defines SFT's checkpoint (slime/stages/definitions.py), as its record is
CACHE = StageCachePolicy.of(SFT, code_modules=("slime.stages.sft",))


@stage_task("sft", CACHE)
def sft(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any] | State:
    """Fine-tune `inputs["load"]` on `inputs["sft_data"]` (tokenizer from `inputs["hf_checkpoint"]`).

    A re-run after a failure resumes from the newest intact SFT checkpoint of the same settings.
    """
    run_config = with_fields(config, checkpoint__load=inputs["load"], sft__sft_data=inputs["sft_data"],
                             checkpoint__hf_checkpoint=inputs["hf_checkpoint"], checkpoint__save=output)
    phases, start = start_stage(SFT, run_config)
    if start.reused is not None:
        return reused(start)
    with phases.time("sft"):
        result = run_sft(run_config)
    return finish_stage(start, summarize("sft", result, config.run.storage_options), phases)
