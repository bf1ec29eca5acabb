"""Weight synchronisation from trainer to engines and the async generation modes (`sync:`), and the checks that
concern them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from slime.config.base import ConfigTree, Fail, _Section


class SyncConfig(_Section):
    """Weight synchronisation from trainer to engines."""

    update_weights_interval: int = Field(1, ge=1, description="`slime rl`: sync the trainer's weights into the "
                                                              "engines every N rollouts (and after the last)")
    async_mode: Literal["off", "one_step_off", "fully"] = Field(
        "off", description="`slime rl` generation beside training: one_step_off generates rollout id+1 while "
                           "training on id (slime's train_async.py; the flag --async, or true, selects it); fully "
                           "generates all the time and trains on finished groups (docs/rl.md)")
    max_policy_version_lag: int | None = Field(
        None, ge=0, description="fully async: the most weight versions a trained sample's oldest token may be "
                                "behind the trainer (slime's --max-policy-version-lag); None: no bound")
    stale_sample_policy: Literal["drop", "regenerate"] = Field(
        "drop", description="fully async: a group past max_policy_version_lag is dropped (kept in "
                            "rollout_dropped/) or generated again from its prompt")
    update_weight_buffer_size: int = Field(512 * 1024**2, ge=1, description="bytes per bucket")
    update_weight_disk_dir: str | None = Field(None, description="disk mode: where weights are written "
                                                "(default: a temporary directory)")
    weight_sync_mode: Literal["auto", "disk", "tensor", "distributed"] = Field(
        "auto", description="auto: tensor when colocated or share_gpu, distributed otherwise (docs/sync.md)")
    weight_sync_timeout_s: float = Field(600.0, gt=0, description="distributed mode: process-group timeout")
    update_weight_transport: Literal["nccl", "disk"] | None = Field(
        None, description="slime's carrier flag: nccl is weight_sync_mode distributed, disk is disk; None: "
                          "weight_sync_mode decides")
    update_weight_mode: Literal["full", "delta"] = Field("full", description="full: every sync sends every "
                                                                             "parameter; delta (disk or distributed): "
                                                                             "only what changed (docs/sync.md)")
    update_weight_delta_encoding: Literal["xor", "overwrite"] = Field(
        "xor", description="delta: xor (new ^ old, apply once) or overwrite (changed positions and values)")
    update_weight_delta_checksum: Literal["xxh3-128", "blake3", "adler32"] = Field(
        "xxh3-128", description="delta: per-tensor checksum of the new bytes, checked when applied (disk) or "
                                "received (distributed, built-in engines)")
    update_weight_local_checkpoint_dir: str | None = Field(
        None, description="delta: the full HF checkpoint the deltas patch and the engines reload (same file system "
                          "as trainer rank 0 here)")
    update_weight_disk_keep_files: bool = Field(False, description="disk mode: keep every weight_version_* "
                                                                   "directory (default: only the newest)")
    custom_update_weight_post_write_path: str | None = Field(
        None, description="disk mode: hook(args, version_dir, rollout_engines) after the files are written, before "
                          "engines read them; rollout_engines are the engine URLs")
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged", description="with LoRA: merged sends base + scale * B @ A through weight_sync_mode; adapter writes "
                              "only the adapters as a PEFT directory under update_weight_disk_dir and the engines "
                              "load it (/load_lora_adapter; requests carry lora_path); docs/lora.md")

    @field_validator("async_mode", mode="before")
    @classmethod
    def _async_flag(cls, value: Any) -> Any:
        """`--async` (a plain flag) and a YAML bool mean one-step-off; false means off."""
        if isinstance(value, bool):
            return "one_step_off" if value else "off"
        return value

    @model_validator(mode="before")
    @classmethod
    def _mode_from_transport(cls, data: Any) -> Any:
        """--update-weight-transport picks weight_sync_mode unless that is set to something else."""
        transport = data.get("update_weight_transport") if isinstance(data, dict) else None
        if transport:
            mode = {"nccl": "distributed", "disk": "disk"}[transport] if transport in ("nccl", "disk") else None
            given = data.get("weight_sync_mode", "auto")
            if mode and given not in ("auto", mode):
                raise ValueError(f"update_weight_transport {transport} means weight_sync_mode {mode}, but "
                                 f"weight_sync_mode is {given}")
            if mode:
                data = {**data, "weight_sync_mode": mode}
        return data


def check_async_mode(config: ConfigTree, fail: Fail) -> None:
    """The generation mode and the staleness bound fit together (slime.rollout.staleness has the arithmetic)."""
    sync, rollout = config.sync, config.rollout
    if sync.async_mode == "fully" and rollout.rollout_function_path != "slime.rollout.generate_rollout":
        fail("rollout.rollout_function_path", "fully async mode runs its own generation loop "
             f"(slime.rollout.fully_async); a custom rollout function ({rollout.rollout_function_path}) runs in the "
             "off or one_step_off modes", "sync.async_mode")
    if sync.async_mode == "fully":
        window = 1 if sync.max_policy_version_lag is None else sync.max_policy_version_lag  # fully_async's window
        if sync.update_weights_interval > window + 1:
            fail("sync.update_weights_interval", f"fully async generation runs at most {window} batch(es) ahead of "
                 f"the engines' weights (max_policy_version_lag, 1 when unset): syncing only every "
                 f"{sync.update_weights_interval} steps would starve it; use at most {window + 1}",
                 "sync.max_policy_version_lag")
        return
    if sync.max_policy_version_lag is None:
        return
    if rollout.partial_rollout:
        fail("sync.max_policy_version_lag", "partial rollout carries tokens across steps, and the bound is enforced "
             "only in fully async mode: set sync.async_mode fully (--async-mode fully)", "rollout.partial_rollout")
    scheduled = sync.update_weights_interval - (sync.async_mode == "off")  # lag the schedule gives every sample
    if scheduled > sync.max_policy_version_lag:
        fail("sync.max_policy_version_lag", f"async_mode {sync.async_mode} with update_weights_interval "
             f"{sync.update_weights_interval} trains samples up to {scheduled} versions behind, above the bound "
             f"{sync.max_policy_version_lag}", "sync.async_mode", "sync.update_weights_interval")


def check_async_gpus(config: ConfigTree, fail: Fail) -> None:
    """Async generation runs beside training, on GPUs of its own."""
    if config.sync.async_mode != "off" and config.cluster.colocate:
        fail("sync.async_mode", f"async ({config.sync.async_mode}) generation needs separate train and rollout "
             "GPUs: it cannot be combined with colocate", "cluster.colocate")


def check_eval_fleet(config: ConfigTree, fail: Fail) -> None:
    """cluster.eval_num_gpus: an eval fleet beside fully async training, reached by a weight sync that can cross
    GPUs (tensor sync is CUDA IPC to an engine on the trainer's own GPU)."""
    c, sync = config.cluster, config.sync
    if not c.eval_num_gpus:
        return
    if sync.async_mode != "fully":
        fail("cluster.eval_num_gpus", "a separate eval fleet runs evals beside fully async training; in "
             f"async_mode {sync.async_mode} the loop evaluates between steps on the rollout engines: set "
             "sync.async_mode fully (--async-mode fully) or unset eval_num_gpus", "sync.async_mode")
    if c.eval_num_gpus % c.rollout_num_gpus_per_engine:
        fail("cluster.eval_num_gpus", f"{c.eval_num_gpus} is not a multiple of rollout_num_gpus_per_engine "
             f"{c.rollout_num_gpus_per_engine}", "cluster.rollout_num_gpus_per_engine")
    mode = "tensor" if sync.weight_sync_mode == "auto" and c.same_gpus else sync.weight_sync_mode
    if sync.lora_sync != "adapter" and mode == "tensor":  # slime.sync.syncer.resolve_mode's rule
        fail("cluster.eval_num_gpus", "the eval engines are on GPUs of their own, which tensor weight sync (CUDA IPC "
             "to an engine on the trainer's GPU) cannot reach: set sync.weight_sync_mode disk or distributed",
             "sync.weight_sync_mode", "cluster.share_gpu")


def check_weight_sync_options(config: ConfigTree, fail: Fail) -> None:
    """The disk-mode and delta options apply to the transport chosen."""
    s = config.sync
    for name in ("update_weight_disk_keep_files", "custom_update_weight_post_write_path"):
        if getattr(s, name) and s.weight_sync_mode != "disk" and s.lora_sync != "adapter":
            fail(f"sync.{name}", f"applies to disk weight sync: set weight_sync_mode disk (or "
                 f"--update-weight-transport disk); it is {s.weight_sync_mode}")
    if s.update_weight_mode == "delta":
        mode = s.weight_sync_mode
        if mode == "auto":
            mode = "tensor" if config.cluster.same_gpus else "distributed"
        if mode == "tensor":
            fail("sync.update_weight_mode", "delta sync runs over the disk or distributed transport, not tensor "
                 f"(colocated CUDA IPC, nothing crosses a wire): weight_sync_mode is {s.weight_sync_mode}"
                 f"{' (tensor: colocate or share_gpu)' if s.weight_sync_mode == 'auto' else ''}; set "
                 "weight_sync_mode disk or distributed (--update-weight-transport disk|nccl) or update_weight_mode full")
        if mode == "disk" and not s.update_weight_local_checkpoint_dir:
            fail("sync.update_weight_mode", "disk delta sync needs update_weight_local_checkpoint_dir (the checkpoint "
                 "the deltas patch)")
        if mode == "distributed" and s.update_weight_local_checkpoint_dir:
            fail("sync.update_weight_local_checkpoint_dir", "only used by the disk delta: the distributed delta "
                 "broadcasts the changed tensors themselves", "sync.weight_sync_mode")
        if mode == "distributed" and s.update_weight_delta_encoding != "xor":
            fail("sync.update_weight_delta_encoding", "applies to the disk delta: the distributed delta broadcasts "
                 "whole changed tensors (an SGLang engine cannot apply a byte delta)", "sync.weight_sync_mode")
    elif s.update_weight_local_checkpoint_dir:
        fail("sync.update_weight_local_checkpoint_dir", "only used by delta sync (--update-weight-mode delta)")


def check_adapter_sync(config: ConfigTree, fail: Fail) -> None:
    """sync.lora_sync adapter: the engines read a PEFT directory from the sync directory and apply it to the base
    (the HF checkpoint they start from, or a base the first sync sends: slime/sync/adapter.py)."""
    s = config.sync
    if s.lora_sync != "adapter":
        return
    if not config.lora.enabled:
        fail("sync.lora_sync", "adapter sync sends LoRA adapters: set lora_rank (or lora_sync merged)", "lora.lora_rank")
    if s.weight_sync_mode not in ("auto", "disk"):
        fail("sync.lora_sync", f"adapter sync writes a PEFT directory the engines load from disk; weight_sync_mode "
             f"{s.weight_sync_mode} sends full tensors (set it to auto or disk, or lora_sync merged)",
             "sync.weight_sync_mode")
    if s.update_weight_mode == "delta":
        fail("sync.lora_sync", "adapter sync already sends the adapters only: delta sync does not apply",
             "sync.update_weight_mode")
    if config.run.check_weight_update_equal:
        fail("run.check_weight_update_equal", "compares the engines' full weights with the HF checkpoint after the "
             "first sync; adapter sync leaves them at the base plus a merged (built-in) or separate (SGLang) adapter",
             "sync.lora_sync")
    if config.engine.engine == "sglang":
        given = config.sglang_arg("max_lora_rank")
        if given is not None and int(given) < config.lora.lora_rank:
            fail("sglang.max_lora_rank", f"{given} is below lora.lora_rank {config.lora.lora_rank}: SGLang would "
                 "refuse the adapter", "lora.lora_rank")
