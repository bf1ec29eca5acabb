"""Task `sft`: supervised fine-tuning from a checkpoint into `{store}/{run_id}/sft/checkpoint`."""

from __future__ import annotations

from typing import Any

from slime.config import Config
from slime.stages.sft import run_sft
from tasks._cache import StageCachePolicy
from tasks._stage import stage_result, stage_task, start_stage, with_fields

OUTPUT_NAME = "checkpoint"
# config fields run_sft reads besides its inputs (model, data, tokenizer) and output location;
# save_interval is left out: it adds intermediate checkpoints, the final one is the same
CONFIG_FIELDS = ("sft.messages_key", "sft.sft_num_epoch", "sft.sft_lr", "sft.sft_min_lr", "sft.sft_lr_warmup_iters",
                 "sft.sft_lr_decay_style", "train", "algorithm.calculate_per_token_loss",
                 "checkpoint.no_save_optim", "data.tool_key", "megatron", "run.seed", "lora")

CACHE = StageCachePolicy(config_fields=CONFIG_FIELDS, code_modules=("slime.stages.sft",))


@stage_task("sft", CACHE)
def sft(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any]:
    """Fine-tune `inputs["load"]` on `inputs["sft_data"]` (tokenizer from `inputs["hf_checkpoint"]`).

    A re-run after a failure resumes from the newest intact SFT checkpoint of the same attempt.
    """
    phases = start_stage(CACHE, config, inputs, output, resumable=True)
    with phases.time("sft"):
        result = run_sft(with_fields(config, checkpoint__load=inputs["load"], sft__sft_data=inputs["sft_data"],
                                     checkpoint__hf_checkpoint=inputs["hf_checkpoint"], checkpoint__save=output))
    metrics = {key: result.get(key) for key in ("steps", "first_loss", "last_loss", "resumed_from", "lora_rank",
                                                "trainable_params", "total_params") if key in result}
    return stage_result("sft", {"checkpoint": (result["checkpoint"], result["manifest_hash"])}, metrics, phases)
