"""The sections of the stages beside training: rejection sampling (`rejection_sampling:`) and HF export
(`export:`)."""

from __future__ import annotations

from pydantic import Field

from slime.config.base import _Section


class RejectionSamplingConfig(_Section):
    """Rejection sampling: N responses per prompt from a policy, scored; the accepted ones become SFT data."""

    rs_prompt_data: str | None = Field(None, description="prompts to sample (JSONL/Parquet, any fsspec URL); "
                                                         "None: data.prompt_data")
    rs_policy: str | None = Field(None, description="policy to sample from: HF dir, exported HF dir or Megatron "
                                                    "checkpoint; None: checkpoint.load, else hf_checkpoint")
    rs_reward_threshold: float | None = Field(1.0, description="accept responses with reward >= this; None: "
                                                               "no threshold")
    rs_best_of_n: int | None = Field(None, ge=1, description="keep at most this many best responses per prompt")
    rs_dedup: bool = Field(True, description="drop identical responses (same tokens) of one prompt")
    rs_keep_truncated: bool = Field(False, description="also accept responses cut at rollout_max_response_len")
    rs_num_engines: int = Field(1, ge=1, description="inference engines started for sampling")
    rs_concurrency: int = Field(64, ge=1, description="generate requests in flight")
    rs_output_name: str = Field("accepted", description="shard set name under {store}/{run_id}/rejection_sampling/")


class ExportConfig(_Section):
    """Megatron checkpoint -> HF safetensors directory."""

    output_dir: str | None = Field(None, description="HF directory to write (must not hold a committed export); "
                                                     "None: {store}/{run_id}/export/hf; relative: under {store}/{run_id}")
    origin_hf_dir: str | None = Field(None, description="HF dir for config and tokenizer; default: the one "
                                                        "recorded in the checkpoint")
    merge: bool = Field(True, description="a LoRA checkpoint: write merged HF weights (base + scale * B @ A); false: "
                                          "a PEFT adapter directory (peft.PeftModel.from_pretrained(base, dir))")
    megatron_lm_layout: bool = Field(False, description="write Megatron-LM's / slime's torch_dist layout instead of HF "
                                                        "(latest_checkpointed_iteration.txt + iter_NNNNNNN/) to "
                                                        "output_dir: the weights; from a one-rank full checkpoint "
                                                        "also optimizer, LR schedule, RNG and slime's data cursor")
