"""What defines each stage's artifact: its inputs, the config values it depends on, and where it is written.

One table for both entry points (`slime <stage>` and the Prefect tasks, whose cache keys use the same fields):
a field that changes what a stage produces belongs here, or a re-run would reuse an artifact that is not what
the config asks for (slime/stages/record.py). Fields that only add intermediate checkpoints, evals or logs
(`sft_save_interval`, `save_interval`) are left out. Evaluate is not here: its result directory is named by
the hash of its settings (`slime.stages.evaluate.plan_evaluate`), so its manifest is its record.
"""

from __future__ import annotations

from typing import Any

from slime.config import Config
from slime.errors import NotCommittedError
from slime.stages.record import StageDefinition
from slime.storage import ArtifactStore, manifest_hash

# where the engine is reached, not what it computes
_ENGINE_ADDRESSES = ("engine.sglang_router_ip", "engine.sglang_router_port", "engine.engine_host")


def _sft_view(config: Config) -> Config:
    return config.model_copy(update={"train": config.sft_train()})


def _rs_policy(config: Config) -> str | None:
    rs = config.rejection_sampling
    return rs.rs_policy or config.checkpoint.load or config.checkpoint.hf_checkpoint


CONVERT = StageDefinition(
    name="convert",
    config_fields=("megatron", "run.seed"),
    inputs=lambda c: {"hf_checkpoint": c.checkpoint.hf_checkpoint},
    output=lambda c: c.checkpoint.save,
    required=("checkpoint.hf_checkpoint", "checkpoint.save"),
)

SFT = StageDefinition(
    name="sft",
    config_fields=("sft", "train", "algorithm.calculate_per_token_loss", "checkpoint.no_save_optim", "data.tool_key",
                   "megatron", "run.seed", "lora"),
    inputs=lambda c: {"load": c.checkpoint.load, "sft_data": c.sft.sft_data, "hf_checkpoint": c.checkpoint.hf_checkpoint},
    output=lambda c: c.checkpoint.save,
    left_out=("sft.sft_data", "sft.sft_save_interval"),
    required=("checkpoint.hf_checkpoint", "sft.sft_data", "checkpoint.save"),
    resumable=True,
    normalize=_sft_view,
)

REJECTION_SAMPLING = StageDefinition(
    name="rejection_sampling",
    config_fields=("rejection_sampling", "rollout", "reward", "data", "engine", "sglang", "run.seed"),
    inputs=lambda c: {"load": _rs_policy(c),
                      "prompt_data": c.rejection_sampling.rs_prompt_data or c.data.prompt_data},
    output=lambda c: ArtifactStore.from_config(c).uri(c.run.run_id, "rejection_sampling"),
    left_out=("rejection_sampling.rs_policy", "rejection_sampling.rs_prompt_data", "data.prompt_data",
              *_ENGINE_ADDRESSES),
    required=("run.run_id",),
)

RL = StageDefinition(
    name="rl",
    config_fields=("rollout", "algorithm", "train", "reward", "sync", "cluster", "engine", "sglang", "megatron",
                   "data", "eval", "checkpoint.no_save_optim", "run.seed", "lora"),
    inputs=lambda c: {"load": c.checkpoint.load, "prompt_data": c.data.prompt_data,
                      "hf_checkpoint": c.checkpoint.hf_checkpoint},
    output=lambda c: c.checkpoint.save,
    left_out=("data.prompt_data", *_ENGINE_ADDRESSES),
    required=("checkpoint.hf_checkpoint", "run.run_id", "checkpoint.save"),
    resumable=True,
    extendable=("rollout.num_rollout",),  # more iterations continue a finished or stopped run
)

EXPORT = StageDefinition(
    name="export",
    config_fields=("export.merge",),
    inputs=lambda c: {"load": c.checkpoint.load, "origin_hf_dir": c.export.origin_hf_dir},
    output=lambda c: c.export.output_dir,
    required=("checkpoint.load", "export.output_dir"),
)

DEFINITIONS: dict[str, StageDefinition] = {d.name: d for d in (CONVERT, SFT, REJECTION_SAMPLING, RL, EXPORT)}


def summarize(stage: str, result: dict[str, Any], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A library stage function's result as the stage result both entry points record:
    {"stage", "artifacts": {name: {"uri", "manifest_hash"}}, "metrics"}."""
    def artifact(uri: str, digest: str | None = None) -> dict[str, str]:
        return {"uri": uri, "manifest_hash": digest or manifest_hash(uri, options)}

    if stage in ("convert", "sft"):
        artifacts = {"checkpoint": artifact(result["checkpoint"], result["manifest_hash"])}
        metrics = {key: result.get(key) for key in ("steps", "first_loss", "last_loss", "resumed_from", "lora_rank",
                                                    "trainable_params", "total_params") if key in result}
    elif stage == "rejection_sampling":
        artifacts = {"accepted": artifact(result["output"]), "candidates": artifact(result["candidates"])}
        metrics = {k: v for k, v in result.items() if k not in ("output", "candidates")}
    elif stage == "rl":
        steps = result.get("steps") or [{}]
        if not result.get("last_checkpoint"):
            raise NotCommittedError("rl finished without a committed checkpoint: set checkpoint.save_interval")
        artifacts = {"checkpoint": artifact(result["last_checkpoint"])}
        metrics = {"start_rollout_id": result["start_rollout_id"], "num_rollout": result["num_rollout"],
                   "resumed": result["resumed"], "iterations_run": result["num_rollout"] - result["start_rollout_id"],
                   "reward_mean_last": steps[-1].get("rl/reward_mean"), "metrics_uri": result["metrics_uri"]}
    elif stage == "export" and "megatron_lm_dir" in result:  # --megatron-lm-layout
        artifacts = {"megatron_lm_checkpoint": artifact(result["megatron_lm_dir"], result["manifest_hash"])}
        metrics = {"source_checkpoint": result["source_checkpoint"], "iteration": result["iteration"]}
    elif stage == "export":
        artifacts = {"hf_model": artifact(result["hf_dir"], result["manifest_hash"])}
        metrics = {"source_checkpoint": result["source_checkpoint"]}
    else:
        raise KeyError(f"no stage definition for {stage!r}; stages: {sorted(DEFINITIONS)}")
    return {"stage": stage, "artifacts": artifacts, "metrics": metrics}
