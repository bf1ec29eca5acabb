"""The run's identity, logging and debug switches (`run:`), the placement of train ranks and engines
(`cluster:`), the model kit (`kit:`), and the checks that concern them."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from slime.config.base import ConfigTree, Fail, _Section
from slime.storage.fs import unknown_protocol

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class RunConfig(_Section):
    """Where artifacts go and how the run is identified."""

    store: str = Field("./runs", description="artifact store root: any fsspec URL (./runs, s3://bucket/x)")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for the store")
    staging_dir: str | None = Field(None, description="local copies of checkpoints and HF directories kept in a "
                                                      "remote store (slime/storage/staging.py); None: slime-staging "
                                                      "in the system's temp directory")
    run_id: str | None = Field(None, description="run directory under the store; reuse it to resume (letters, "
                                                 "digits, '.', '_', '-'; no '/' or '..')")
    seed: int = Field(1234, description="global seed (Megatron, data order, sampling)")
    overwrite: bool = Field(False, description="consent to move aside (never delete) a stage output of this run that "
                                               "was made with other settings, and run the stage again; without it "
                                               "such an output is refused, naming the differing fields "
                                               "(slime/stages/record.py)")
    use_tensorboard: bool = Field(False, description="`slime rl`: also write step metrics to TensorBoard (needs the "
                                                     "tensorboard package)")
    tensorboard_dir: str | None = Field(None, description="local TensorBoard log dir; None: {store}/{run_id}/rl/"
                                                          "tensorboard (local stores only)")
    tb_project_name: str | None = Field(None, description="slime's TensorBoard naming: when tensorboard_dir is unset, "
                                                          "logs go to tensorboard_log/{project}/{experiment}")
    tb_experiment_name: str | None = Field(None, description="with tb_project_name; None: the run_id (slime: a "
                                                             "timestamp)")
    train_backend: Literal["megatron"] = Field("megatron", description="slime's trainer choice; Megatron is the one "
                                                                       "this project has")
    custom_config_path: str | None = Field(None, description="YAML of extra attributes plugins find on `args` "
                                                             "(slime's --custom-config-path); config field names "
                                                             "are refused")
    save_debug_rollout_data: str | None = Field(None, description="mapped: every rollout is committed to the store "
                                                                  "as a shard set; no .pt dump is written")
    save_debug_train_data: str | None = Field(None, description="mapped: the trainer's input is the committed "
                                                                "rollout shard set; no .pt dump is written")
    dump_details: str | None = Field(None, description="mapped: the store keeps every rollout shard set, checkpoint, "
                                                       "eval and metrics line of the run")
    use_wandb: bool = Field(False, description="`slime rl`: also log step metrics to W&B with slime's names and "
                                               "step axes (slime/rl/tracking.py; needs the wandb package)")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="None: wandb's default (WANDB_MODE, else online); offline writes {wandb_dir}/wandb/")
    wandb_dir: str | None = Field(None, description="where W&B writes its files; None: ./wandb")
    wandb_key: str | None = Field(None, exclude=True, description="W&B API key for online mode (never stored "
                                                                  "with the config)")
    wandb_host: str | None = Field(None, description="W&B server URL for the login")
    wandb_team: str | None = Field(None, description="W&B entity")
    wandb_group: str | None = Field(None, description="W&B group; None: the run_id; a random suffix is added")
    wandb_project: str | None = Field(None, description="W&B project")
    disable_wandb_random_suffix: bool = Field(False, description="W&B group and run name without slime's random "
                                                                 "6-character suffix")
    wandb_always_use_train_step: bool = Field(False, description="W&B: every metric against train/step (default: "
                                                                 "rollout/step except train/*)")
    wandb_run_id: str | None = Field(None, description="continue this W&B run (resume 'allow')")
    log_passrate: bool = Field(False, description="log passrate/pass@k (k = 1, 2, 4 ... group size) of every "
                                                  "rollout, reward 1 counting as correct")
    log_multi_turn: bool = Field(False, description="log multi_turn/*: response lengths with and without "
                                                    "environment tokens, rounds per sample")
    log_reward_category: str | None = Field(None, description="log error_cat/<value>: the share of samples whose dict "
                                                              "reward has each value under this key")
    debug_rollout_only: bool = Field(False, description="mapped: `slime rl` generates rollouts (and evals) into "
                                                        "the store without a trainer")
    debug_train_only: bool = Field(False, description="mapped: `slime rl` trains on stored rollouts "
                                                      "(load_debug_rollout_data) without engines")
    load_debug_rollout_data: str | None = Field(None, description="mapped: URI template of committed rollout shard "
                                                                  "sets, {rollout_id} formatted; implies "
                                                                  "debug_train_only")
    load_debug_rollout_data_subsample: float | None = Field(
        None, gt=0, le=1, description="train on this share of each stored rollout: the first and last quarter of "
                                      "int(rows x share) rows, as slime (whole groups here)")
    log_correct_samples: bool = Field(False, description="log rollout/correct_length/p25..p100 (correct responses "
                                                         "by response-length quartile) and rollout/correct_entropy")
    profile_target: list[Literal["train_overall", "train_actor", "train_log_probs"]] = Field(
        ["train_overall"], min_length=1, description="what megatron.use_pytorch_profiler and record_memory_history "
                                                     "cover (slime/backends/megatron/profile.py)")
    record_memory_history: bool = Field(False, description="with train_overall: record the train rank's allocator "
                                                           "history and dump it after memory_snapshot_num_steps "
                                                           "rollouts (torch: CUDA only)")
    memory_snapshot_dir: str = Field(".", description="where memory snapshots are written")
    memory_snapshot_num_steps: int | None = Field(None, ge=1, description="dump the memory snapshot after this many "
                                                                          "rollouts")
    memory_recorder: Literal["torch", "memray"] = Field("torch", description="torch: torch.cuda.memory history "
                                                        "(JSON snapshot); memray: memray.Tracker (needs memray)")

    @model_validator(mode="before")
    @classmethod
    def _load_implies_train_only(cls, data: Any) -> Any:
        """slime: replaying stored rollouts starts no engines."""
        if isinstance(data, dict) and data.get("load_debug_rollout_data") and data.get("debug_train_only") is None:
            data = {**data, "debug_train_only": True}
        return data

    check_weight_update_equal: bool = Field(False, description="`slime rl`: engines snapshot and zero their "
                                                               "weights before the first sync, which must restore "
                                                               "them exactly (/weights_checker); fails the run if not")
    ci_test: bool = Field(False, description="`slime rl`: fail the run when slime's invariants break (slime/ray/ci_checks.py:"
                                             " train/rollout log-prob gap, first-step ppo_kl, initial KL)")
    ci_disable_kl_checker: bool = Field(False, description="ci_test without the KL checks")
    ci_train_rollout_logprob_abs_diff_threshold: float = Field(
        0.1, ge=0, description="ci_test: bound on train/train_rollout_logprob_abs_diff")
    ci_save_grad_norm: str | None = Field(None, description="save each step's grad norm to this path template "
                                                            "({role}, {rollout_id}, {step_id}), JSON")
    ci_load_grad_norm: str | None = Field(None, description="compare each step's grad norm with the one saved at "
                                                            "this template (tolerance 0.01)")

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_from_tb_names(cls, data: Any) -> Any:
        """slime's --tb-project-name/--tb-experiment-name give the TensorBoard directory when none is set."""
        if isinstance(data, dict) and data.get("tb_project_name") and not data.get("tensorboard_dir"):
            experiment = data.get("tb_experiment_name") or data.get("run_id") or "default"
            data = {**data, "tensorboard_dir": f"tensorboard_log/{data['tb_project_name']}/{experiment}"}
        return data

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_name(cls, value: str | None) -> str | None:
        # one directory under the store: a '/' or '..' would write into another run or outside the store
        if value is not None and not RUN_ID_PATTERN.fullmatch(value):
            raise ValueError(f"run id {value!r} must be one directory name: letters, digits, '.', '_', '-', "
                             "starting with a letter or digit (no '/' or '..')")
        return value


DEFAULT_GPU_FRACTION = 0.5  # share_gpu: each side's part of a shared GPU unless set


class ClusterConfig(_Section):
    """Placement of train actors and rollout engines (slime's cluster flags)."""

    actor_num_nodes: int = Field(1, ge=1)
    actor_num_gpus_per_node: int = Field(1, ge=1)
    rollout_num_gpus: int | None = Field(None, ge=0, description="None: actor GPU count when colocated")
    rollout_num_gpus_per_engine: int = Field(1, ge=1)
    eval_num_gpus: int = Field(0, ge=0, description="fully async: GPUs (on CPU: engine processes) of a separate "
                                                     "eval engine fleet, in engines of rollout_num_gpus_per_engine; "
                                                     "evals run there on the weights synced for them while "
                                                     "training and generation go on (docs/rl.md); 0: evals on "
                                                     "the rollout engines, the trainer waiting for them")
    num_gpus_per_node: int = Field(8, ge=1)
    colocate: bool = Field(False, description="train and rollout share GPUs (implies both offloads)")
    offload: bool = Field(False, description="slime's shorthand: offload_train and offload_rollout both true")
    offload_train: bool | None = Field(None, description="None: same as colocate")
    offload_rollout: bool | None = Field(None, description="None: same as colocate")
    release_train: bool = Field(False, description="`slime rl`: end the train rank processes after each sync and "
                                                    "start new ones from the rollout's checkpoint (saved every "
                                                    "rollout) before the next train step")
    share_gpu: bool = Field(False, description="decoupled, but each engine on a train rank's GPU (bundle), both "
                                               "resident with a fraction of it (train_gpu_fraction, "
                                               "rollout_gpu_fraction): async modes on one GPU (docs/ray.md)")
    train_gpu_fraction: float | None = Field(None, gt=0, lt=1, description="share_gpu: the Ray GPU request and the "
                                                                           "torch memory cap of each train rank; None: 0.5")
    rollout_gpu_fraction: float | None = Field(None, gt=0, lt=1, description="share_gpu: the Ray GPU request and the "
                                                                             "memory budget of each engine; None: 0.5")
    ray_address: str | None = Field(None, description="join an existing Ray cluster; None starts a local one")
    distributed_timeout_minutes: int = Field(10, ge=1, description="the train ranks' torch.distributed timeout")

    @model_validator(mode="before")
    @classmethod
    def _offload_sets_both(cls, data: Any) -> Any:
        """slime: --offload is --offload-train plus --offload-rollout; an explicit false of either conflicts."""
        if isinstance(data, dict) and data.get("offload"):
            off = [n for n in ("offload_train", "offload_rollout") if data.get(n) is False]
            if off:
                raise ValueError(f"offload is set but {off[0]} is false: offload means both offloads")
            data = {**data, "offload_train": True, "offload_rollout": True}
        return data

    @property
    def train_gpus(self) -> int:
        """Train ranks: actor_num_nodes x actor_num_gpus_per_node."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        """GPUs of the rollout engines: rollout_num_gpus, or when unset the train GPUs (colocate, share_gpu) or one
        engine's (decoupled)."""
        if self.rollout_num_gpus is not None:
            return self.rollout_num_gpus
        return self.train_gpus if self.same_gpus else self.rollout_num_gpus_per_engine

    @property
    def same_gpus(self) -> bool:
        """Train ranks and engines on the same GPUs (colocate or share_gpu): weight sync `auto` is tensor."""
        return self.colocate or self.share_gpu

    def gpu_fractions(self) -> tuple[float, float]:
        """(train, rollout) fraction of a shared GPU (share_gpu), defaults filled in."""
        return (self.train_gpu_fraction or DEFAULT_GPU_FRACTION, self.rollout_gpu_fraction or DEFAULT_GPU_FRACTION)


class KitConfig(_Section):
    """A generated model kit (slime/data/tiny.py: tokenizer, model, task data) that the config's paths point
    into; every entry point builds it when `kit_dir` holds none, before anything starts."""

    kit_recipe: str | None = Field(None, description="recipe YAML of the kit (datasets/<kit>/recipe.yaml); relative: "
                                                     "to the config file's directory")
    kit_dir: str | None = Field(None, description="local directory the kit is built in when missing; relative: to "
                                                  "the config file's directory")


def check_share_gpu(config: ConfigTree, fail: Fail) -> None:
    """cluster.share_gpu: both sides stay resident on one GPU, so their parts must fit it and nothing may
    offload; NCCL refuses two ranks of one communicator on one GPU, so weights go by tensor (or disk)."""
    c = config.cluster
    if not c.share_gpu:
        for name in ("train_gpu_fraction", "rollout_gpu_fraction"):
            if getattr(c, name) is not None:
                fail(f"cluster.{name}", "applies only with cluster.share_gpu (--share-gpu): set it, or unset "
                     f"{name}")
        return
    if c.colocate:
        fail("cluster.share_gpu", "share_gpu keeps train ranks and engines resident side by side, colocate makes "
             "them take turns (offload): choose one", "cluster.colocate")
    for name in ("offload_train", "offload_rollout"):
        if getattr(c, name):
            fail("cluster.share_gpu", f"share_gpu keeps both sides resident: {name} (or offload) cannot be set with "
                 "it", f"cluster.{name}", "cluster.offload")
    train, rollout = c.gpu_fractions()
    if train + rollout > 1:
        fail("cluster.share_gpu", f"train_gpu_fraction {train:g} + rollout_gpu_fraction {rollout:g} = "
             f"{train + rollout:g} is more than one GPU", "cluster.train_gpu_fraction", "cluster.rollout_gpu_fraction")
    if config.sync.weight_sync_mode == "distributed":
        fail("sync.weight_sync_mode", "distributed (NCCL) sync cannot run between a train rank and an engine on "
             "the same GPU (NCCL refuses two ranks on one device) under cluster.share_gpu: use auto (tensor) or "
             "disk", "cluster.share_gpu", "sync.update_weight_transport")
    static = config.sglang_arg("mem_fraction_static")
    if config.engine.engine == "sglang" and static is not None and float(static) > rollout:
        fail("sglang.mem_fraction_static", f"{static} is above the engine's part of the shared GPU, "
             f"rollout_gpu_fraction {rollout:g}", "cluster.rollout_gpu_fraction")


def check_store(config: ConfigTree, fail: Fail) -> None:
    """run.store names a storage protocol fsspec knows."""
    if (protocol := unknown_protocol(config.run.store)) is not None:
        fail("run.store", f"unknown storage protocol {protocol!r} in {config.run.store!r}: use a local path or an "
             "fsspec URL (s3://bucket/prefix, gs://..., memory://...)")


def check_debug_modes(config: ConfigTree, fail: Fail) -> None:
    """debug_rollout_only and debug_train_only exclude each other; training only needs stored rollouts."""
    if config.run.debug_rollout_only and config.run.debug_train_only:
        fail("run.debug_train_only", "debug_rollout_only and debug_train_only exclude each other (slime)",
             "run.debug_rollout_only", "run.load_debug_rollout_data")
    if config.run.debug_train_only and not config.run.load_debug_rollout_data:
        fail("run.debug_train_only", "needs load_debug_rollout_data (--load-debug-rollout-data): the stored rollout "
             "shard sets to train on, e.g. runs/RUN/rollout/{rollout_id:06d}")


def check_release_train(config: ConfigTree, fail: Fail) -> None:
    """cluster.release_train: the recreated train ranks resume from each rollout's full checkpoint."""
    if config.cluster.release_train:
        if not config.checkpoint.save or config.checkpoint.no_save_optim:
            fail("cluster.release_train", "the recreated train ranks resume from a full checkpoint of each rollout: "
                 "set checkpoint.save and leave no_save_optim off", "checkpoint.no_save_optim")
        if config.sync.async_mode != "off":
            fail("cluster.release_train", "async mode trains while generating: the train ranks cannot be released",
                 "sync.async_mode")


def check_memory_recorder(config: ConfigTree, fail: Fail) -> None:
    """memray's tracker needs to know when to stop."""
    if config.run.memory_recorder == "memray" and config.run.record_memory_history and \
            config.run.memory_snapshot_num_steps is None:
        fail("run.memory_recorder", "memray needs memory_snapshot_num_steps (when to stop the tracker), as in slime")


def check_rollout_subsample(config: ConfigTree, fail: Fail) -> None:
    """load_debug_rollout_data_subsample needs stored rollouts."""
    if config.run.load_debug_rollout_data_subsample and not config.run.load_debug_rollout_data:
        fail("run.load_debug_rollout_data_subsample", "subsamples stored rollouts: set load_debug_rollout_data")


def check_grad_norm_files(config: ConfigTree, fail: Fail) -> None:
    """ci_test's grad norms are saved or compared, not both."""
    if config.run.ci_save_grad_norm and config.run.ci_load_grad_norm:
        fail("run.ci_load_grad_norm", "set ci_save_grad_norm or ci_load_grad_norm, not both", "run.ci_save_grad_norm")
