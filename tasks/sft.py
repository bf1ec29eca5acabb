"""Task `sft`: supervised fine-tuning from a checkpoint into `{store}/{run_id}/sft/checkpoint`."""

from __future__ import annotations

from typing import Any

from prefect import task

from slime.config import Config
from slime.sft import run_sft
from tasks._cache import StageCachePolicy
from tasks._stage import Phases, clear_output, stage_result, with_fields

OUTPUT_NAME = "checkpoint"
# config fields run_sft reads besides its inputs (model, data, tokenizer) and output location
CONFIG_FIELDS = ("sft.messages_key", "sft.sft_num_epoch", "train", "algorithm.calculate_per_token_loss",
                 "data.tool_key", "megatron", "run.seed")


@task(name="sft", task_run_name="sft-{run_id}", persist_result=True, result_serializer="json",
      cache_policy=StageCachePolicy(config_fields=CONFIG_FIELDS, code_modules=("slime.sft",)))
def sft(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any]:
    """Fine-tune `inputs["load"]` on `inputs["sft_data"]` (tokenizer from `inputs["hf_checkpoint"]`)."""
    phases = Phases()
    with phases.time("clear output"):
        clear_output(output, config.run.storage_options)
    with phases.time("sft"):
        result = run_sft(with_fields(config, checkpoint__load=inputs["load"], sft__sft_data=inputs["sft_data"],
                                     checkpoint__hf_checkpoint=inputs["hf_checkpoint"], checkpoint__save=output))
    metrics = {key: result[key] for key in ("steps", "first_loss", "last_loss")}
    return stage_result("sft", {"checkpoint": (result["checkpoint"], result["manifest_hash"])}, metrics, phases)
