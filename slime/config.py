"""The one typed configuration tree: YAML file, then `--flag value` overrides, validated once.

Layout. The YAML file is nested by section (`rollout:`, `algorithm:`, ...); every field name is
unique across sections and keeps slime's flag name, so `--rollout-batch-size 8` on the command line
sets `rollout.rollout_batch_size`, exactly as a slime user would write it. Three sections are
pass-through dicts instead of typed fields:

* `sglang`: every `--sglang-<flag>` (SGLang `ServerArgs`), forwarded verbatim to the engines;
* `router`: every `--router-<flag>` (sglang-router), forwarded to the router;
* `megatron`: Megatron flags that slime does not model itself (`--tensor-model-parallel-size 2`),
  checked against megatron-core's config dataclasses when an unknown flag is seen; the model's own
  (`TransformerConfig`) options reach the model through `bridge.model_options`. Megatron-LM's `--no-X`
  fusion flags are stored as the option they set False (`slime/megatron_flags.py`).

Errors name the file and line (YAML) or the flag (CLI) that is wrong. `section_hash` gives a stable
content hash of any section, which the orchestration layer uses as a cache key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import hashlib
import json
import logging
import os
import re
import warnings
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from slime.engine_flags import (
    DTYPES,
    RENAMED_SGLANG_ARGS,
    check_router_args,
    check_sglang_args,
    external_engine_urls,
    flag_key,
    known_sglang_flags,
    renamed_sglang_args,
    request_timeout_s,
)
from slime.errors import ConfigError
from slime.megatron_flags import (
    LAUNCH,
    LAUNCH_ACCEPTED,
    NEGATED,
    launch_problems,
    negated_options,
    no_effect_notes,
    option_problems,
    renamed_options,
)
from slime.slime_flags import (
    LAUNCHER_ROUTER,
    MAPPED,
    PLUGIN_ONLY,
    RAY_CLI,
    refusal,
)
from slime.storage.fs import unknown_protocol

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- sections

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    wandb_project: str | None = None
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
    def same_gpus(self) -> bool:
        """Train ranks and engines on the same GPUs (colocate or share_gpu): weight sync `auto` is tensor."""
        return self.colocate or self.share_gpu

    def gpu_fractions(self) -> tuple[float, float]:
        """(train, rollout) fraction of a shared GPU (share_gpu), defaults filled in."""
        return (self.train_gpu_fraction or DEFAULT_GPU_FRACTION, self.rollout_gpu_fraction or DEFAULT_GPU_FRACTION)


class CheckpointConfig(_Section):
    """Model sources and checkpoint destinations."""

    hf_checkpoint: str | None = Field(None, description="HF model dir: tokenizer, engine init, conversion source")
    model_name: str | None = None
    ref_load: str | None = Field(None, description="reference model checkpoint (KL, initial weights)")
    load: str | None = Field(None, description="checkpoint to resume from")
    save: str | None = Field(None, description="checkpoint directory; None: {store}/{run_id}/<stage>/checkpoint; "
                                               "relative: under {store}/{run_id}")
    save_interval: int | None = Field(None, ge=1, description="RL: save every N rollouts, and at the "
                                                              "end (SFT: sft_save_interval)")
    save_hf: str | None = Field(None, description="also write HF weights here when saving")
    ref_ckpt_step: int | None = Field(None, ge=0, description="load iteration N of ref_load (default: its newest "
                                                              "committed checkpoint)")
    opd_teacher_load: str | None = Field(None, description="on-policy distillation (opd_type megatron): the teacher's "
                                                           "Megatron checkpoint (a committed one or a --save root), "
                                                           "of the student's architecture and vocabulary")
    opd_teacher_ckpt_step: int | None = Field(None, ge=0, description="load iteration N of opd_teacher_load (default: "
                                                                      "its newest committed checkpoint)")
    no_save_optim: bool = Field(False, description="save the model only: no optimizer, scheduler or RNG state "
                                                   "(such a checkpoint cannot resume training)")
    no_load_optim: bool = Field(False, description="Megatron's --no-load-optim: start from the full checkpoint `load` "
                                                   "names with its weights, iteration, RNG and caller state but a fresh "
                                                   "optimizer and LR schedule (a resume of this run's own `save` stays "
                                                   "full)")
    no_load_rng: bool = Field(False, description="Megatron's --no-load-rng: start from the full checkpoint `load` names "
                                                 "without its RNG state (the generators keep run.seed's)")
    finetune: bool = Field(False, description="Megatron's --finetune: take only the weights of the checkpoint `load` "
                                              "names: iteration 0, fresh optimizer, schedule and data cursor (a resume "
                                              "of this run's own `save` stays full)")
    dist_ckpt_optim_fully_reshardable: bool = Field(
        False, description="DistributedOptimizer state as 'fully_reshardable' (any parallel layout can load it) "
                           "instead of 'dp_reshardable' (same TP/PP)")
    async_save: bool = Field(False, description="slime's/Megatron's --async-save: a save copies the state to host "
                                                "memory and training goes on while background processes write it; "
                                                "committed once every rank's files are durable (a crash mid-write "
                                                "leaves the previous checkpoint the newest)")
    keep_checkpoints: int | None = Field(None, ge=1, description="keep only the newest N committed checkpoints under "
                                                                 "`save` (older ones are deleted after each commit; "
                                                                 "verl's max_actor_ckpt_to_keep, OpenRLHF's "
                                                                 "--max_ckpt_num); None: keep every one")


class DataConfig(_Section):
    """Prompt data (JSONL or Parquet at any fsspec URL; `path@[a:b]` slices)."""

    prompt_data: str | None = None
    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = "metadata"
    tool_key: str | None = "tools"
    apply_chat_template: bool = False
    apply_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    rollout_shuffle: bool = False
    rollout_max_prompt_len: int | None = Field(None, ge=1)
    num_epoch: int | None = Field(None, ge=1, description="sets num_rollout from the data size when unset")
    disable_rollout_global_dataset: bool = Field(False, description="no prompt data: the rollout gets groups of "
                                                                    "empty samples with fresh ids and a custom "
                                                                    "rollout function makes the prompts")
    data_source_path: str = Field("slime.data.source.RolloutDataSource", description="data-source class, built as "
                                  "cls(args), with slime's get_samples(num_samples), add_samples(groups), __len__ "
                                  "(slime/data/source.py)")
    start_rollout_id: int | None = Field(None, ge=0, description="`slime rl`: first rollout id; None: the resumed "
                                                                 "checkpoint's next, else 0")


class RolloutConfig(_Section):
    """Generation: batch shape, sampling parameters and the rollout plugins."""

    rollout_batch_size: int | None = Field(None, ge=1, description="prompts (groups) per rollout step")
    n_samples_per_prompt: int = Field(1, ge=1)
    over_sampling_batch_size: int | None = Field(None, ge=1, description="groups submitted at once")
    num_rollout: int | None = Field(None, ge=0, description="RL steps; 0 means evaluation only")
    rollout_temperature: float = Field(1.0, gt=0)
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    rollout_top_k: int = -1
    rollout_max_response_len: int | None = Field(None, ge=1)
    rollout_max_context_len: int | None = Field(
        None, ge=2, description="prompt + response tokens of a rollout sample: each request asks for at most "
        "min(max_new_tokens, this - prompt tokens), and a prompt that leaves no room gives a TRUNCATED sample "
        "without a request; rollout_max_prompt_len defaults to this - 1 and eval_max_context_len to this (slime)")
    rollout_stop: list[str] | None = None
    rollout_stop_token_ids: list[int] | None = None
    rollout_skip_special_tokens: bool = False
    rollout_seed: int = 42
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    sglang_server_concurrency: int = Field(512, ge=1, description="in-flight requests per engine")
    rollout_http_timeout_s: float | None = Field(
        None, gt=0, description="read timeout of a generate request (rollout, eval, rejection sampling): a "
        "non-streaming /generate is silent until the response is done, so this bounds a generation. None (slime's "
        "client): no limit here; the router bounds every request (--sglang-router-request-timeout-secs, else "
        "sglang-router's 1800 s, per attempt, and it retries a timed-out one) and its error fails the sample. "
        "Refused below the router's request timeout: a cut here is not retried and leaves the engine generating; "
        "to bound generations lower the router's")
    rollout_function_path: str = "slime.rollout.generate_rollout"
    custom_generate_function_path: str | None = None
    dynamic_sampling_filter_path: str | None = None
    buffer_filter_path: str | None = None
    rollout_sample_filter_path: str | None = None
    rollout_all_samples_process_path: str | None = None
    rollout_sample_hook_path: list[str] = Field(default_factory=list, description="hook(args, sample, *, rollout_id, "
                                                "evaluation) -> Sample or None on each generated sample before its "
                                                "reward; sync or async; repeat the flag for several")
    custom_rollout_log_function_path: str | None = Field(None, description="log(rollout_id, args, samples, "
                                                         "rollout_extra_metrics, rollout_time) -> bool; true: the "
                                                         "step's default rollout/* metrics are not logged")
    custom_eval_rollout_log_function_path: str | None = Field(None, description="log(rollout_id, args, data, "
                                                              "extra_metrics) -> bool; true: the default eval/* "
                                                              "metrics are not logged")
    eval_function_path: str | None = Field(None, description="rollout function for eval, called with evaluation="
                                                             "True; None: rollout_function_path")
    rollout_data_transport: Literal["object-store", "nixl"] = Field(
        "object-store", description="mapped: rollout data reaches the trainer as an Arrow shard set in the store")
    # slime's rollout-buffer settings: its own code never reads them, its rollout-buffer example plugin does
    rollout_buffer_url: str | None = Field(None, description="for plugins (args.rollout_buffer_url): the rollout "
                                                             "buffer server's URL")
    fetch_trajectory_retry_times: int = Field(-1, description="for plugins: fetch retries, -1 unlimited")
    min_batch_collection_ratio: float = Field(1, description="for plugins: share of a batch to collect")
    rollout_task_type: str = Field("math", description="for plugins: the rollout buffer's task type")


class RewardConfig(_Section):
    """How responses are scored."""

    rm_type: str | None = Field(None, description="built-in reward (math, math_verify, dapo, deepscaler, f1, gpqa, ...)")
    rm_url: str | None = Field(None, description="endpoint for rm_type remote_rm")
    custom_rm_path: str | None = None
    group_rm: bool = False
    reward_key: str | None = Field(None, description="entry of a dict reward to train on")
    grading_processes: int | None = Field(
        None, ge=1, description="child processes that grade sympy/math-verify answers in parallel, each call with "
                                "its time limit (None: half the CPU cores, at most 8)")
    custom_reward_post_process_path: str | None = Field(None, description="fn(args, samples) -> (raw_rewards, "
                                                          "rewards) instead of the group normalisation "
                                                          "(slime/backends/megatron/hooks.py)")
    custom_convert_samples_to_train_data_path: str | None = Field(
        None, description="fn(args, samples) -> slime's train_data dict (rewards, loss_masks, ...): replaces the "
                          "trainer's reward normalisation and loss masks (slime/ray/train_actor.py)")


AdvantageEstimator = Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]


class AlgorithmConfig(_Section):
    """Advantage estimator and loss (slime's names and defaults)."""

    advantage_estimator: AdvantageEstimator = "grpo"
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = "policy_loss"
    custom_loss_function_path: str | None = None
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float | None = Field(None, gt=0, description="None: same as eps_clip")
    eps_clip_c: float | None = Field(None, description="dual-clip constant; must be > 1")
    value_clip: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0, description="KL as a reward penalty (exclusive with use_kl_loss)")
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    entropy_coef: float = 0.0
    gamma: float = Field(1.0, ge=0, le=1)
    lambd: float = Field(1.0, ge=0, le=1)
    normalize_advantages: bool = False
    disable_rewards_normalization: bool = False
    disable_grpo_std_normalization: bool = False
    use_rollout_logprobs: bool = False
    use_tis: bool = False
    tis_clip: float = Field(2.0, gt=0)
    tis_clip_low: float = Field(0.0, ge=0)
    calculate_per_token_loss: bool = False
    custom_tis_function_path: str | None = Field(
        None, description="with use_tis: slime's TIS function fn(args=, pg_loss=, train_log_probs=, rollout_log_probs="
                          ", loss_masks=, total_lengths=, response_lengths=) -> (pg_loss, loss_masks, metrics)")
    custom_pg_loss_reducer_function_path: str | None = Field(
        None, description="fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer "
                          "for pg_loss only (slime's); other terms keep the default reduction")
    use_rollout_entropy: bool = Field(False, description="also compute the actor's per-token entropy in the "
                                                         "log-prob pass: rollout/entropy, rollout_data['entropy'] for "
                                                         "the data hooks")
    get_mismatch_metrics: bool = Field(False, description="log train/mismatch/{tis,tis_clipfrac,tis_abs,ois}: the "
                                                          "trainer/engine importance ratios (no reweighting here)")
    use_unbiased_kl: bool = Field(False, description="KL loss weighted by the importance ratio pi / pi_old")
    use_opsm: bool = Field(False, description="off-policy sequence masking: no policy loss for a sequence with a "
                                              "negative advantage whose mean old - new log-prob exceeds opsm_delta")
    opsm_delta: float = Field(1e-4, ge=0, description="OPSM's sequence-KL threshold")
    keep_old_actor: bool = Field(False, description="old log-probs under a host copy of the weights the engines "
                                                    "generated with (not the current actor): the previous sync's "
                                                    "with update_weights_interval 1 (one-step-off), else the last")
    ref_update_interval: int | None = Field(None, ge=1, description="copy the actor's weights into the KL reference "
                                                                    "every N rollouts (after training rollout N-1)")
    disable_compute_advantages_and_returns: bool = Field(
        False, description="no reference/old log-prob passes and no advantage estimator: advantages come with the "
                           "samples (metadata['advantage']), the ratio's denominator is the step's own log-probs")
    use_opd: bool = Field(False, description="on-policy distillation: advantages -= opd_kl_coef * (student - "
                                             "teacher log-prob) per response token (docs/rl.md)")
    opd_type: Literal["megatron", "sglang"] | None = Field(
        None, description="where the teacher's log-probs come from: megatron (a frozen teacher model in the train "
                          "ranks, checkpoint.opd_teacher_load); sglang is refused here (docs/rl.md)")
    opd_kl_coef: float = Field(1.0, description="weight of the OPD reverse-KL penalty on the advantages")


class TrainConfig(_Section):
    """Optimisation and batching of the trainer."""

    global_batch_size: int | None = Field(None, ge=1, description="samples per optimizer step")
    num_steps_per_rollout: int | None = Field(None, ge=1, description="alternative to global_batch_size")
    micro_batch_size: int = Field(1, ge=1)
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    lr: float = Field(1e-6, gt=0, description="peak learning rate (after warmup)")
    clip_grad: float = Field(1.0, ge=0)
    optimizer: Literal["adam", "sgd"] = Field("adam", description="adam is AdamW (decoupled weight decay); sgd "
                                                                  "has no momentum")
    weight_decay: float = Field(0.0, ge=0, description="Megatron's default is 0.01, slime's scripts use 0.1")
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.98, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    fused_adam: bool | None = Field(None, description="torch's fused AdamW kernel in place of the foreach one "
                                                      "megatron builds without Apex/TE; None: on under CUDA "
                                                      "(slime/backends/megatron/optimizer.py)")
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = Field(
        "constant", description="megatron-core OptimizerParamScheduler; stepped once per optimizer step")
    lr_warmup_iters: int = Field(0, ge=0, description="linear warmup from lr_warmup_init to lr, in optimizer steps")
    lr_decay_iters: int | None = Field(None, ge=1, description="steps from 0 to min_lr; None: the stage's total "
                                                               "optimizer steps")
    lr_wsd_decay_iters: int | None = Field(None, ge=1, description="WSD: length of the final decay phase")
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"
    min_lr: float = Field(0.0, ge=0)
    lr_warmup_init: float = Field(0.0, ge=0, description="learning rate of the first warmup step")
    use_distributed_optimizer: bool = Field(False, description="shard optimizer state over data-parallel ranks "
                                                               "(megatron DistributedOptimizer)")
    train_env_vars: dict[str, str] = Field(default_factory=dict, description="environment variables of the train "
                                                                             "rank processes (Ray runtime_env)")
    log_probs_max_tokens_per_gpu: int | None = Field(None, ge=1, description="dynamic batch size of the log-prob "
                                                     "passes (no backward: may be larger); None: max_tokens_per_gpu")
    only_train_params_name_list: list[str] | None = Field(None, description="regexes of the Megatron parameter "
                                                          "names to train; every other parameter is frozen")
    freeze_params_name_list: list[str] | None = Field(None, description="regexes of the Megatron parameter names "
                                                      "to freeze (slime/backends/megatron/freeze.py)")
    reset_optimizer_states: bool = Field(False, description="zero Adam's step and moments after each rollout's "
                                                            "training")
    use_stateless_adam: bool = Field(False, description="Adam whose moments start from zero at every optimizer step "
                                                        "(slime's StatelessAdam update); needs no_save_optim")
    data_pad_size_multiplier: int = Field(1, ge=1, description="right-pad every micro-batch's sequence length to a "
                                                               "multiple of this")
    log_probs_chunk_size: int = Field(-1, description="score response positions in chunks of this many (log-softmax "
                                                      "over the vocabulary per chunk, less peak memory); -1: the "
                                                      "scorer's default (chunks of ~2^26 fp32 values, or all at "
                                                      "once under tensor parallelism); the values do not change")
    compile_scores: bool | None = Field(None, description="torch.compile the log-softmax over the vocabulary that "
                                                          "scores response tokens (forward and backward, chunk by "
                                                          "chunk: fused kernels, no fp32 copy of the logits); "
                                                          "unset: on under CUDA with Triton; false: eager kernels")
    fp32_logits: bool = Field(False, description="upcast the [B, S, V] logits to fp32 before scoring them "
                                                 "(megatron's Float16Module does by default); false: the scoring "
                                                 "reads the bf16 logits, upcasting chunk by chunk (the same "
                                                 "values, without an fp32 copy of the logits and its gradient)")
    megatron_config_path: str | None = Field(None, description="slime's per-role Megatron YAML (megatron: [{name, "
                                                               "role: actor, overrides: {...}}]): the actor entry's "
                                                               "overrides win over flags and YAML; critic: ignored")
    recompute_loss_function: bool = Field(False, description="score the logits and compute the loss under "
                                                             "torch.utils.checkpoint: recomputed in the backward "
                                                             "pass instead of keeping the softmax activations")
    balance_by_flops: bool = Field(False, description="dynamic batching: ceil(tokens / max_tokens_per_gpu) "
                                                      "micro-batches of even estimated FLOPs (Karmarkar-Karp) "
                                                      "instead of first-fit; may pass the token limit, as in slime")
    balance_data: bool = Field(False, description="split each step's samples over data-parallel ranks by "
                                                  "Karmarkar-Karp on estimated forward FLOPs (equal counts)")
    custom_advantage_function_path: str | None = Field(
        None, description="fn(args, rollout_data) sets advantages and returns, instead of the estimator "
                          "(slime/backends/megatron/hooks.py)")
    rollout_data_postprocess_path: str | None = Field(
        None, description="fn(args, rollout_id, rollout_data) after the advantages; may change advantages and "
                          "loss_masks")
    custom_megatron_init_path: str | None = Field(None, description="init(args), after Megatron's process groups "
                                                                    "(slime/backends/megatron/hooks.py)")
    custom_megatron_before_log_prob_hook_path: str | None = Field(
        None, description="hook(args, model, store_prefix) before each log-prob pass ('' actor, 'ref_' reference)")
    custom_megatron_before_train_step_hook_path: str | None = Field(
        None, description="hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) before each step")


class SftConfig(_Section):
    """Supervised fine-tuning (cold start) data and epochs."""

    sft_data: str | None = Field(None, description="chat-messages JSONL/Parquet or an SFT shard set URI")
    messages_key: str = "messages"
    loss_mask_type: Literal["qwen", "qwen3", "qwen3_5", "distill_qwen"] | None = Field(
        None, description="slime's per-message loss masks for chat templates without {% generation %} blocks "
                          "(slime/data/loss_mask.py); None: the template's generation marks")
    sft_num_epoch: int = Field(1, ge=1)
    sft_save_interval: int | None = Field(None, ge=1, description="save the full SFT training state every N "
                                          "optimizer steps (resume point); None: only at the end")
    # SFT usually wants a larger step size than RL from the same `train` section: these override it for SFT only
    sft_lr: float | None = Field(None, gt=0, description="SFT's peak learning rate; None: train.lr")
    sft_min_lr: float | None = Field(None, ge=0, description="SFT's final learning rate; None: train.min_lr")
    sft_lr_warmup_iters: int | None = Field(None, ge=0, description="SFT's warmup steps; None: "
                                            "train.lr_warmup_iters")
    sft_lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] | None = Field(
        None, description="SFT's learning-rate schedule; None: train.lr_decay_style")

    def train_overrides(self) -> dict[str, Any]:
        """The `train` fields SFT sets differently (only those given)."""
        given = {"lr": self.sft_lr, "min_lr": self.sft_min_lr, "lr_warmup_iters": self.sft_lr_warmup_iters,
                 "lr_decay_style": self.sft_lr_decay_style}
        return {k: v for k, v in given.items() if v is not None}


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


class EvalConfig(_Section):
    """Periodic and stand-alone evaluation."""

    eval_interval: int | None = Field(None, ge=1)
    eval_prompt_data: dict[str, str] | None = Field(None, description="dataset name -> path")
    eval_config: str | None = Field(None, description="YAML with per-dataset eval settings")
    skip_eval_before_train: bool = False
    n_samples_per_eval_prompt: int = Field(1, ge=1)
    eval_temperature: float | None = Field(None, ge=0)
    eval_top_p: float | None = Field(None, gt=0, le=1)
    eval_top_k: int | None = None
    eval_max_response_len: int | None = Field(None, ge=1)
    eval_input_key: str | None = None
    eval_label_key: str | None = None
    eval_tool_key: str | None = Field(None, description="eval prompts' tools key; None: tool_key")
    eval_reward_key: str | None = Field(None, description="entry of a dict reward that eval reports; None: "
                                                          "reward_key")
    eval_max_context_len: int | None = Field(None, ge=1, description="rollout_max_context_len for eval samples; "
                                                                     "None: rollout_max_context_len (slime)")
    eval_max_prompt_len: int | None = Field(None, ge=1, description="drop eval prompts longer than this many "
                                                                    "tokens (needs hf_checkpoint's tokenizer)")
    eval_min_new_tokens: int | None = Field(None, ge=0, description="eval responses are at least this long (SGLang "
                                                                    "min_new_tokens)")
    eval_num_engines: int = Field(1, ge=1, description="`slime evaluate`: inference engines started for the eval")
    eval_watch_run: str | None = Field(None, description="`slime evaluate`: evaluate the newest committed "
                                                         "checkpoint of this run (same store) instead of --load; "
                                                         "skip when it was evaluated with this config already")
    eval_watch_stages: list[str] = Field(["rl", "sft", "convert"], min_length=1,
                                         description="eval_watch_run: stages whose {run}/{stage}/checkpoint are "
                                                     "searched, first with a committed checkpoint wins")


class EngineConfig(_Section):
    """Which inference engine serves rollouts and where the router is."""

    engine: Literal["builtin", "sglang"] = "builtin"
    rollout_external_engine_addrs: list[str] | None = Field(
        None, description="engines a user started (host:port or URL): registered with the router instead of "
                          "launched; stopping the run leaves them running (slime/engines/fleet.py)")
    http_proxy: str | None = Field(None, description="for plugins (args.http_proxy); engines and the router are "
                                                     "reached on 127.0.0.1 without it")
    sglang_router_ip: str = "127.0.0.1"
    sglang_router_port: int | None = Field(None, ge=1, le=65535, description="None: pick a free port")
    engine_host: str = Field("127.0.0.1", description="address the engine servers bind; 0.0.0.0 (or the node's IP) "
                                                      "when the router is on another node: engines are then "
                                                      "registered by their node's IP (docs/ray.md)")
    use_fault_tolerance: bool = Field(False, description="`slime rl`: poll every engine's /health_generate; a dead "
                                                         "engine is restarted, re-synced and re-registered (docs/ray.md)")
    rollout_health_check_interval: float = Field(30.0, gt=0, description="fault tolerance: seconds between two "
                                                                         "health checks of the engines")
    rollout_health_check_timeout: float = Field(30.0, gt=0, description="fault tolerance: seconds a /health_generate "
                                                                        "may take before it counts as failed")
    rollout_health_check_first_wait: float = Field(0.0, ge=0, description="fault tolerance: seconds before the first "
                                                                          "check after start and after each onload")
    rollout_health_check_failures: int = Field(1, ge=1, description="fault tolerance: failed checks in a row after "
                                                                    "which an engine is restarted")
    rollout_max_engine_restarts: int = Field(3, ge=0, description="fault tolerance: restarts per engine in a run; "
                                                                  "past it the engine stays down, the others go on")


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


class KitConfig(_Section):
    """A generated model kit (slime/data/tiny.py: tokenizer, model, task data) that the config's paths point
    into; every entry point builds it when `kit_dir` holds none, before anything starts."""

    kit_recipe: str | None = Field(None, description="recipe YAML of the kit (datasets/<kit>/recipe.yaml); relative: "
                                                     "to the config file's directory")
    kit_dir: str | None = Field(None, description="local directory the kit is built in when missing; relative: to "
                                                  "the config file's directory")


# HF module names (what PEFT and SGLang's --lora-target-modules use) -> the megatron-core linear holding them
LORA_HF_TO_MEGATRON = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                       "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
LORA_MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LoraConfig(_Section):
    """LoRA adapters on the Megatron trainer's linear layers (docs/lora.md): base weights frozen, engines get
    base + scale * B @ A."""

    lora_rank: int = Field(0, ge=0, description="adapter rank r; 0: LoRA off (full fine-tuning)")
    lora_alpha: float = Field(16.0, gt=0, description="scale = lora_alpha / lora_rank, as in PEFT")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (training only)")
    target_modules: list[str] = Field(["all-linear"], min_length=1, description="all-linear, or HF names (q_proj "
                                      "k_proj v_proj o_proj gate_proj up_proj down_proj) or Megatron ones (linear_qkv "
                                      "linear_proj linear_fc1 linear_fc2); a comma-separated string also works. q/k/v "
                                      "and gate/up are fused in Megatron: name all of a fused group or none")
    lora_adapter_path: str | None = Field(None, description="start from the adapters of this LoRA checkpoint "
                                                            "(iter_* dir or --save root) instead of fresh ones")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list) and all(isinstance(v, str) for v in items):
            return [part.strip() for v in items for part in v.split(",") if part.strip()]
        return value

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        lora_megatron_targets(value)  # raises on a name that cannot map or a partial fused group
        return value

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def megatron_targets(self) -> list[str]:
        """The Megatron linear layers that get adapters, in model order."""
        return lora_megatron_targets(self.target_modules)


def lora_megatron_targets(names: list[str]) -> list[str]:
    """`target_modules` as Megatron linear names. Refuses an unknown name, and a fused layer named only in part
    (q_proj without k_proj and v_proj: one adapter on linear_qkv would change all three)."""
    if "all-linear" in names:
        if len(names) > 1:
            raise ValueError(f"target_modules: all-linear already names every linear layer; drop {names}")
        return list(LORA_MEGATRON_TARGETS)
    chosen = set()
    for name in names:
        if name in LORA_MEGATRON_TARGETS:
            chosen.add(name)
        elif name in LORA_HF_TO_MEGATRON:
            fused = sorted(k for k, v in LORA_HF_TO_MEGATRON.items() if v == LORA_HF_TO_MEGATRON[name])
            missing = [k for k in fused if k not in names]
            if missing:
                raise ValueError(f"target_modules: {name} lives in Megatron's fused {LORA_HF_TO_MEGATRON[name]} "
                                 f"with {', '.join(k for k in fused if k != name)}; name all of {', '.join(fused)} "
                                 f"(missing {', '.join(missing)}) or none of them")
            chosen.add(LORA_HF_TO_MEGATRON[name])
        else:
            raise ValueError(f"target_modules: {name!r} maps to no Megatron linear layer; use all-linear or "
                             f"{', '.join([*LORA_HF_TO_MEGATRON, *LORA_MEGATRON_TARGETS])}")
    return [t for t in LORA_MEGATRON_TARGETS if t in chosen]


class Config(BaseModel):
    """The whole configuration. Sections are typed; `sglang`, `router`, `megatron` pass through."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run: RunConfig = Field(default_factory=RunConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    rejection_sampling: RejectionSamplingConfig = Field(default_factory=RejectionSamplingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    kit: KitConfig = Field(default_factory=KitConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    sglang: dict[str, Any] = Field(default_factory=dict)
    router: dict[str, Any] = Field(default_factory=dict)
    megatron: dict[str, Any] = Field(default_factory=dict)
    # dotted field -> where it was set ("file.yaml:12" or "--flag"), for messages of later checks
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _context_defaults(self) -> Config:
        """slime's defaults from rollout_max_context_len: eval_max_context_len is the same bound, and prompts
        are at most rollout_max_context_len - 1 tokens, leaving one generated token for the loss (_validate
        refuses a larger rollout_max_prompt_len)."""
        context = self.rollout.rollout_max_context_len
        if self.eval.eval_max_context_len is None and context is not None:
            self.eval.eval_max_context_len = context
        if self.data.rollout_max_prompt_len is None and context is not None:
            self.data.rollout_max_prompt_len = context - 1
        return self

    @field_validator("megatron", mode="before")
    @classmethod
    def _negated_flags(cls, value: Any) -> Any:
        """Megatron-LM's `--no-rope-fusion` & co. become the megatron-core field they set False, and its other
        names of megatron-core fields (`--decoder-first-pipeline-num-layers`) that field (megatron_flags)."""
        return negated_options(renamed_options(value)) if isinstance(value, dict) else value

    def source(self, dotted: str) -> str | None:
        """Where `section.field` was set (YAML file and line, or the CLI flag); None for a default."""
        return self._sources.get(dotted)

    def section_hash(self, *sections: str) -> str:
        """sha256 of the canonical JSON of the named sections (all of them when none is named), each with the
        values set away from their defaults.

        Stable across processes and key order; any changed value changes it. Fields left at their defaults are
        not in it, so a later version that adds a field with a default (or a config that spells a default
        out) keeps the hash, and a committed output keyed by it (rejection sampling's) stays reusable. Hashes
        of this project before 2026-11-26 covered every field.
        """
        names = sections or tuple(type(self).model_fields)
        for name in names:
            if name not in type(self).model_fields:
                raise ConfigError(f"unknown config section {name!r}; sections: {list(type(self).model_fields)}")
        payload = {name: _set_values(getattr(self, name)) for name in names}
        return stable_hash(payload)

    def sglang_arg(self, name: str) -> Any:
        """The SGLang pass-through flag `name` (underscored, `mem_fraction_static`), however its key was
        spelt (`--sglang-mem-fraction-static`, a YAML `mem-fraction-static`); None when not given."""
        return next((v for k, v in self.sglang.items() if str(k).replace("-", "_") == name), None)

    def sft_train(self) -> TrainConfig:
        """The `train` section as SFT uses it: with the sft_lr/sft_min_lr/... overrides applied."""
        return self.train.model_copy(update=self.sft.train_overrides())

    def require(self, *fields: str, stage: str) -> None:
        """Fail early, naming every missing field, when a stage needs fields that default to None."""
        missing = []
        for dotted in fields:
            section, name = dotted.split(".")
            if getattr(getattr(self, section), name) is None:
                missing.append(f"{dotted} (--{name.replace('_', '-')})")
        if missing:
            raise ConfigError(f"stage {stage!r} needs: {', '.join(missing)}")

    def as_namespace(self) -> argparse.Namespace:
        """Flat `args` with slime's attribute names, for plugins written against slime.

        Pass-through sections appear as `sglang_<flag>` / `router_<flag>` attributes and Megatron
        flags under their own names, as slime's merged parser would give them.
        """
        flat: dict[str, Any] = {}
        for section in _TYPED_SECTIONS:
            flat.update(getattr(self, section).model_dump())
        flat.update({f"sglang_{k}": v for k, v in self.sglang.items()})
        flat.update({f"router_{k}": v for k, v in self.router.items()})
        for key, value in self.megatron.items():
            flat.setdefault(key, value)
        if self.run.custom_config_path:  # slime sets these on args after parsing
            flat.update(read_custom_config(self.run.custom_config_path))
        return argparse.Namespace(**flat)


_PASS_THROUGH = ("sglang", "router", "megatron")
_TYPED_SECTIONS = tuple(name for name in Config.model_fields if name not in _PASS_THROUGH)


def _build_field_index() -> dict[str, str]:
    """flat field name -> section. Names must be unique so that flat CLI flags are unambiguous."""
    index: dict[str, str] = {}
    for section in _TYPED_SECTIONS:
        for name in Config.model_fields[section].annotation.model_fields:
            if name in index:
                raise RuntimeError(f"config field {name!r} is defined in both {index[name]!r} and {section!r}")
            index[name] = section
    return index


FIELD_SECTION: dict[str, str] = _build_field_index()


# ----------------------------------------------------------------------------- hashing


def _set_values(value: Any) -> Any:
    """A section as JSON with only its values set away from their defaults (a dict section: all of it)."""
    return value.model_dump(mode="json", exclude_defaults=True) if isinstance(value, BaseModel) else value


def stable_hash(payload: Any) -> str:
    """sha256 hex of canonical JSON (sorted keys, no whitespace): equal content, equal hash."""
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- YAML


def _key_lines(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    """Record the 1-based line of every mapping key, by dotted path, for error messages."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            out[path] = key_node.start_mark.line + 1
            _key_lines(value_node, path, out)


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    lines: dict[str, int] = {}
    _key_lines(node, "", lines)
    return data, lines


def _check_yaml_keys(data: dict[str, Any], where: dict[str, str]) -> None:
    """Unknown sections or fields, with the section a misplaced flat key belongs to."""
    for key, value in data.items():
        if key in _PASS_THROUGH:
            if not isinstance(value, dict):
                raise ConfigError(f"{where.get(key, key)}: section {key!r} must be a mapping")
            continue
        if key not in _TYPED_SECTIONS:
            hint = f"; it belongs under '{FIELD_SECTION[key]}:'" if key in FIELD_SECTION else _suggest(
                key, [*_TYPED_SECTIONS, *_PASS_THROUGH]
            )
            raise ConfigError(f"{where.get(key, key)}: unknown section {key!r}{hint}")
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where.get(key, key)}: section {key!r} must be a mapping")
        for name in value:
            if FIELD_SECTION.get(name) != key:
                path = f"{key}.{name}"
                if name in FIELD_SECTION:
                    hint = f"; it belongs under '{FIELD_SECTION[name]}:'"
                elif why := refusal(name):
                    hint = f"; slime's --{name.replace('_', '-')} is not supported here: {why}"
                else:
                    hint = _suggest(name, [n for n, s in FIELD_SECTION.items() if s == key])
                raise ConfigError(f"{where.get(path, path)}: unknown field {path!r}{hint}")


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# ----------------------------------------------------------------------------- CLI overrides


def _scalar(text: str) -> Any:
    """A pass-through value as a typed scalar: JSON/YAML number, bool, list or dict, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, int | float | bool | list | dict) else text


def _field_kind(section: str, name: str) -> str:
    """'bool', 'list', 'dict' or 'scalar': decides how many CLI tokens a flag consumes."""
    annotation = Config.model_fields[section].annotation.model_fields[name].annotation
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    kinds = {get_origin(a) or a for a in members} - {type(None)}
    if kinds == {bool}:
        return "bool"
    if list in kinds:
        return "list"
    if dict in kinds:
        return "dict"
    return "scalar"


_FLAG_ALIASES = {"async": "async_mode"}  # slime's spelling, not a Python identifier
# slime's argparse.BooleanOptionalAction flags: `--no-offload-train` is slime's own spelling of false
_NEGATABLE = frozenset({"offload_train", "offload_rollout"})


def parse_overrides(tokens: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """`--flag value` tokens -> (nested override dict, dotted path -> flag for error messages).

    Bool flags take no value (`--colocate`) or an explicit one (`--colocate false`); list flags take
    values up to the next `--flag`; dict flags take JSON (`--eval-prompt-data` also accepts
    `name path [name path ...]`, as in slime).
    """
    nested: dict[str, Any] = {}
    origin: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}: options look like --rollout-batch-size 8")
        flag, _, inline = token[2:].partition("=")
        values: list[str] = [inline] if inline else []
        i += 1
        if not inline:
            while i < len(tokens) and not (tokens[i].startswith("--") and len(tokens[i]) > 2):
                values.append(tokens[i])
                i += 1
        name = flag.replace("-", "_")
        name = _FLAG_ALIASES.get(name, name)
        if name.startswith("no_") and name[3:] in _NEGATABLE:
            if values:
                raise ConfigError(f"{token} takes no value (slime's negated --{flag[3:]}); give --{flag[3:]} "
                                  f"{' '.join(values)} instead")
            name, section = name[3:], FIELD_SECTION[name[3:]]
            nested.setdefault(section, {})[name] = False
            origin[f"{section}.{name}"] = f"--{flag}"
            continue
        for prefix in ("sglang", "router"):
            if name.startswith(prefix + "_") and name not in FIELD_SECTION:
                key = name[len(prefix) + 1 :]
                nested.setdefault(prefix, {})[key] = _pass_value(token, values)
                origin[f"{prefix}.{key}"] = f"--{flag}"
                break
        else:
            if name in FIELD_SECTION:
                section = FIELD_SECTION[name]
                aliased = flag.replace("-", "_") in _FLAG_ALIASES
                nested.setdefault(section, {})[name] = True if aliased and not values else \
                    _typed_value(token, _field_kind(section, name), values)  # --async: a plain flag
                origin[f"{section}.{name}"] = f"--{flag}"
            else:
                nested.setdefault("megatron", {})[name] = _pass_value(token, values)
                origin[f"megatron.{name}"] = f"--{flag}"
    return nested, origin


def _pass_value(flag: str, values: list[str]) -> Any:
    if not values:
        return True  # store_true style flag
    parsed = [_scalar(v) for v in values]
    return parsed[0] if len(parsed) == 1 else parsed


def _typed_value(flag: str, kind: str, values: list[str]) -> Any:
    if kind == "bool":
        if not values:
            return True
        if len(values) == 1 and values[0].lower() in {"true", "false", "1", "0", "yes", "no"}:
            return values[0].lower() in {"true", "1", "yes"}
        raise ConfigError(f"{flag}: expected no value or true/false, got {' '.join(values)!r}")
    if not values:
        raise ConfigError(f"{flag}: missing value")
    if kind == "list":
        return values
    if kind == "dict":
        if len(values) == 1:
            try:
                parsed = json.loads(values[0])
            except ValueError:
                raise ConfigError(f"{flag}: expected a JSON object, got {values[0]!r}") from None
            if not isinstance(parsed, dict):
                raise ConfigError(f"{flag}: expected a JSON object, got {values[0]!r}")
            return parsed
        if len(values) % 2:
            raise ConfigError(f"{flag}: expected JSON or 'name value' pairs, got {len(values)} values")
        return dict(zip(values[::2], values[1::2], strict=True))
    if len(values) != 1:
        raise ConfigError(f"{flag}: expected one value, got {' '.join(values)!r}")
    return values[0]


# ----------------------------------------------------------------------------- loading


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply `--flag value` overrides, validate everything once."""
    data: dict[str, Any] = {}
    where: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        data, lines = _read_yaml(path)
        where = {key: f"{path}:{line}" for key, line in lines.items()}
        _check_yaml_keys(data, where)
        data = {k: v for k, v in data.items() if v is not None}
        _resolve_inputs(data, path.absolute().parent)
    if overrides:
        nested, origin = parse_overrides(overrides)
        data = _merge(data, nested)
        where.update(origin)
    role_path = (data.get("train") or {}).get("megatron_config_path")
    if role_path:
        nested, origin = read_megatron_role_config(role_path, "actor")
        data = _merge(data, nested)
        where.update(origin)
    if isinstance(data.get("sglang"), dict):
        _move_router_flags(data, where)
        data["sglang"] = _renamed_sglang(data["sglang"], where)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, where)) from None
    renamed = {name: flag.field for name, flag in LAUNCH.items() if flag.kind == "renamed"}
    for name, field in {**NEGATED, **renamed}.items():  # later messages about the field name the flag that set it
        if f"megatron.{name}" in where and field in config.megatron:
            where.setdefault(f"megatron.{field}", where[f"megatron.{name}"])
    _validate(config, where)
    config._sources = where
    _log_mapped(config, where)
    return config


def _move_router_flags(data: dict[str, Any], where: dict[str, str]) -> None:
    """slime's `--sglang-router-*` flags that set an option of the router (slime_flags.LAUNCHER_ROUTER) land in
    the `sglang` section by their prefix; move each to the `router` section under the router's option name."""

    sglang = data["sglang"]
    for key in [k for k in sglang if f"sglang_{flag_key(str(k))}" in LAUNCHER_ROUTER]:
        name = f"sglang_{flag_key(str(key))}"
        option, why = LAUNCHER_ROUTER[name]
        value, router = sglang.pop(key), data.setdefault("router", {})
        source = where.get(f"sglang.{key}", f"--{name.replace('_', '-')}")
        if not isinstance(router, dict):
            raise ConfigError(f"{where.get('router', 'router')}: section 'router' must be a mapping")
        given = next((k for k in router if flag_key(str(k)) == option), None)
        if given is not None and router[given] != value:
            raise ConfigError(f"{source}: slime's --{name.replace('_', '-')} {value!r} sets the router's "
                              f"--{option.replace('_', '-')}, which is also given as {router[given]!r}; keep one")
        router[given if given is not None else option] = value
        where.setdefault(f"router.{given if given is not None else option}", source)
        logger.info("--%s: passed to the router as --router-%s: %s", name.replace("_", "-"),
                    option.replace("_", "-"), why)


def _renamed_sglang(sglang: dict[str, Any], where: dict[str, str]) -> dict[str, Any]:
    """The `sglang` section with the old SGLang flag names of slime's scripts (`--sglang-cuda-graph-max-bs`) under
    the names the SGLang validated against has (sglang_server.RENAMED_SGLANG_ARGS), each rename logged; later
    messages about the new name name the flag that was given."""

    if not any(flag_key(str(key)) in RENAMED_SGLANG_ARGS for key in sglang):
        return sglang  # nothing to rename: SGLang's flags are not looked up here
    version, flags = known_sglang_flags()
    try:
        out, renamed = renamed_sglang_args(sglang, flags)
    except ConfigError as exc:
        given = [where[f"sglang.{key}"] for key in sglang if f"sglang.{key}" in where]
        raise ConfigError(f"{', '.join(given) or 'config'}: {exc}") from None
    for key, new in renamed.items():
        if f"sglang.{key}" in where:
            where.setdefault(f"sglang.{new}", where[f"sglang.{key}"])
        why = RENAMED_SGLANG_ARGS[flag_key(key)][1]
        logger.info("--sglang-%s: SGLang %s names it --%s, passed to the engines as --sglang-%s: %s",
                    flag_key(key).replace("_", "-"), version, new.replace("_", "-"), new.replace("_", "-"), why)
    return out


# inputs a stage reads (model, tokenizer, data, eval files, the kit); the pre-flight checks that they exist
INPUT_PATH_FIELDS = ("checkpoint.hf_checkpoint", "checkpoint.ref_load", "checkpoint.opd_teacher_load",
                     "checkpoint.load", "data.prompt_data",
                     "sft.sft_data", "rejection_sampling.rs_prompt_data", "rejection_sampling.rs_policy",
                     "eval.eval_prompt_data", "eval.eval_config", "export.origin_hf_dir", "kit.kit_recipe",
                     "kit.kit_dir", "lora.lora_adapter_path")


def resolve_input_path(value: Any, base: Path) -> Any:
    """A relative local path written in a YAML file, as a path from the file's directory `base` (URLs,
    absolute paths and non-strings stay as they are)."""
    if not isinstance(value, str) or "://" in value or not value:
        return value
    return os.path.normpath(base / os.path.expanduser(value))  # an absolute path stays itself


def _resolve_inputs(data: dict[str, Any], base: Path) -> None:
    """Relative local input paths set in a YAML file resolve against the file's directory, so a config
    means the same files from any working directory (CLI values stay relative to the working directory)."""
    for dotted in INPUT_PATH_FIELDS:
        section, name = dotted.split(".")
        values = data.get(section)
        if not isinstance(values, dict) or name not in values:
            continue
        value = values[name]
        values[name] = ({k: resolve_input_path(v, base) for k, v in value.items()} if isinstance(value, dict)
                        else resolve_input_path(value, base))


def _log_mapped(config: Config, where: dict[str, str]) -> None:
    """One log line per slime flag given that this project does its own way (slime_flags.MAPPED) or that
    only plugins read (slime_flags.PLUGIN_ONLY)."""
    for name, how in {**MAPPED, **PLUGIN_ONLY}.items():
        section = getattr(config, FIELD_SECTION[name])
        given = f"{FIELD_SECTION[name]}.{name}" in where
        if given or getattr(section, name) != type(section).model_fields[name].default:
            logger.info("--%s: %s", name.replace("_", "-"), how)
    for flag, why in no_effect_notes(config.megatron).items():  # Megatron-LM launch flags without a knob here
        logger.info("%s: accepted without effect here: %s", flag, why)


def read_megatron_role_config(path: str, role: str) -> tuple[dict[str, Any], dict[str, str]]:
    """slime's --megatron-config-path: the `overrides` (or `args`) of the one entry with `role` in the file's
    top-level `megatron` list, as a nested config update (typed fields to their sections, Megatron flags to
    the pass-through) and where each came from. As in slime, num_nodes/num_gpus_per_node are ignored (the
    cluster flags place the GPUs) and numbers YAML reads as strings (1e-5) become numbers."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"megatron_config_path {path}: no such file")
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"megatron_config_path {path}: invalid YAML: {exc}") from None
    entries = raw.get("megatron") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"megatron_config_path {path}: needs a top-level 'megatron' list, e.g. megatron: [{{name: "
                          "default, role: actor, overrides: {...}}]")
    mine = [e for e in entries if e.get("role") == role]
    if len(mine) > 1:
        raise ConfigError(f"megatron_config_path {path}: {len(mine)} entries with role {role}; at most one")
    for other in {e.get("role") for e in entries} - {role}:
        logger.info("megatron_config_path %s: role %r is not trained here (the RL train group runs the actor)",
                    path, other)
    values = (mine[0].get("overrides") or mine[0].get("args") or {}) if mine else {}
    if not isinstance(values, dict):
        raise ConfigError(f"megatron_config_path {path}: the {role} entry's overrides must be a mapping")
    nested: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in values.items():
        if key in ("num_nodes", "num_gpus_per_node"):
            logger.info("megatron_config_path %s: %s ignored: GPU placement follows the cluster flags", path, key)
            continue
        if isinstance(value, str):
            value = _scalar(value)
        section = FIELD_SECTION.get(key)
        if section is None and key not in megatron_flag_names() and key not in NEGATED and key not in LAUNCH:
            raise ConfigError(f"megatron_config_path {path}: {role} override {key!r} is neither a config field nor "
                              f"a Megatron flag{_suggest(key, [*FIELD_SECTION, *megatron_flag_names(), *LAUNCH])}")
        nested.setdefault(section or "megatron", {})[key] = value
        origin[f"{section or 'megatron'}.{key}"] = f"{path} ({role} overrides.{key})"
    return nested, origin


def read_custom_config(path: str) -> dict[str, Any]:
    """The attributes a --custom-config-path YAML adds to plugins' `args`; config field names are refused
    (set those as flags: they are validated)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"custom_config_path {path}: no such file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"custom_config_path {path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"custom_config_path {path}: expected a mapping of names to values, got "
                          f"{type(data).__name__}")
    typed = sorted(set(data) & set(FIELD_SECTION))
    if typed:
        raise ConfigError(f"custom_config_path {path}: {typed[0]!r} is a config field: set it as "
                          f"--{typed[0].replace('_', '-')} (or {FIELD_SECTION[typed[0]]}.{typed[0]}), where it "
                          "is validated")
    return data


def _format_validation_error(exc: ValidationError, where: dict[str, str]) -> str:
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        # the most specific known location: field, then its section
        dotted = ".".join(loc[:2])
        source = where.get(dotted) or where.get(loc[0]) or "config"
        given = f" (got {err['input']!r})" if err["type"] != "missing" and not isinstance(err["input"], dict) else ""
        problems.append(f"{source}: {'.'.join(loc)}: {err['msg']}{given}")
    return "invalid configuration:\n  " + "\n  ".join(problems)


_SFT_SCHEDULE_FIELDS = {"lr": "sft.sft_lr", "min_lr": "sft.sft_min_lr", "lr_warmup_iters": "sft.sft_lr_warmup_iters",
                        "lr_decay_style": "sft.sft_lr_decay_style"}


def check_async_mode(config: Config, fail: Any) -> None:
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


def _check_load_flags(config: Config, fail: Any) -> None:
    """--finetune / --no-load-optim / --no-load-rng shape the start from the checkpoint `load` names; `save`
    holds this run's own checkpoints, which always resume in full (the resume promise; docs/rl.md "Starting from
    another checkpoint"), so the two must differ (Megatron-LM scripts often pass one directory as both)."""
    ck = config.checkpoint
    given = [name for name in ("finetune", "no_load_optim", "no_load_rng") if getattr(ck, name)]
    if not (given and ck.load and ck.save) or not ("://" in ck.save or os.path.isabs(ck.save)):
        return  # a relative save lies under {store}/{run_id}: a run directory of its own

    def norm(path: str) -> str:
        return path.rstrip("/") if "://" in path else os.path.normpath(os.path.abspath(path))

    load, save = norm(ck.load), norm(ck.save)
    if load == save or load.startswith(save + "/"):
        fail(f"checkpoint.{given[0]}", f"--{given[0].replace('_', '-')} applies to the checkpoint --load names when "
             "the run starts from it, but --save is the same directory: its checkpoints are this run's own and "
             "resume in full after a restart. Give --save a directory of its own", "checkpoint.load",
             "checkpoint.save")


def _check_adapter_sync(config: Config, fail: Any) -> None:
    """sync.lora_sync adapter: the engines read a PEFT directory from the sync directory and apply it to the base
    (the HF checkpoint they start from, or a base the first sync sends: slime/sync/adapter.py)."""
    s = config.sync
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


def _check_share_gpu(config: Config, fail: Any) -> None:
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


def _check_opd(config: Config, fail: Any) -> None:
    """On-policy distillation, as slime validates it (opd_type required; a Megatron teacher needs
    opd_teacher_load, which means nothing without use_opd), plus what is not built here."""
    a, ck = config.algorithm, config.checkpoint
    if not a.use_opd:
        if ck.opd_teacher_load is not None:
            fail("checkpoint.opd_teacher_load", "is set but use_opd is not: add --use-opd (and --opd-type megatron)",
                 "algorithm.use_opd")
        return
    if a.opd_type is None:
        fail("algorithm.opd_type", "--use-opd needs --opd-type: megatron (a teacher checkpoint in the train ranks, "
             "--opd-teacher-load)", "algorithm.use_opd")
    if a.opd_type == "sglang":
        fail("algorithm.opd_type", "sglang is not built here (slime's teacher engine behind --rm-url returns a dict "
             "reward and its --custom-reward-post-process-path hook copies the teacher's log-probs into "
             "sample.teacher_log_probs; the train ranks here take a teacher's log-probs only from a Megatron "
             "teacher, and the rollout's reward metrics need a scalar reward); use --opd-type megatron with the "
             "teacher's Megatron checkpoint as --opd-teacher-load", "algorithm.use_opd")
    if ck.opd_teacher_load is None:
        fail("checkpoint.opd_teacher_load", "--opd-type megatron needs the teacher's Megatron checkpoint "
             "(--opd-teacher-load)", "algorithm.opd_type")
    if config.lora.enabled:
        fail("algorithm.use_opd", "a Megatron OPD teacher next to LoRA adapters is not built here: train without "
             "LoRA, or merge the adapters first", "lora.lora_rank")


def _validate(config: Config, where: dict[str, str]) -> None:
    """Checks that span fields; each message names the fields and where they were set."""

    def fail(field: str, message: str, *related: str) -> None:
        """Raise naming `field` and where it (and each related field that was set) came from."""
        source = where.get(field, "config")
        others = [f"{r} set at {where[r]}" for r in related if r in where]
        also = f" [{'; '.join(others)}]" if others else ""
        raise ConfigError(f"{source}: {field}: {message}{also}")

    r, a, t = config.rollout, config.algorithm, config.train
    if a.loss_type == "custom_loss":  # refused here, not at the first train step after the engines started
        fail("algorithm.loss_type", "custom_loss (slime's --custom-loss-function-path, called with Megatron's "
             "batch and logits) is not supported by the Megatron train step here; use policy_loss or sft_loss, "
             "and reshape the training signal with --custom-advantage-function-path or "
             "--rollout-data-postprocess-path (docs/megatron.md)", "algorithm.custom_loss_function_path")
    if r.rollout_batch_size and t.global_batch_size:
        samples = r.rollout_batch_size * r.n_samples_per_prompt
        if samples % t.global_batch_size:
            fail(
                "train.global_batch_size",
                f"rollout_batch_size * n_samples_per_prompt = {r.rollout_batch_size} * "
                f"{r.n_samples_per_prompt} = {samples} must be a multiple of global_batch_size "
                f"({t.global_batch_size})",
                "rollout.rollout_batch_size",
                "rollout.n_samples_per_prompt",
            )
    if t.global_batch_size and t.num_steps_per_rollout:
        fail("train.num_steps_per_rollout", "set either global_batch_size or num_steps_per_rollout, not both")
    if t.global_batch_size and t.global_batch_size % t.micro_batch_size and not t.use_dynamic_batch_size:
        fail("train.micro_batch_size", f"global_batch_size {t.global_batch_size} is not a multiple of "
             f"micro_batch_size {t.micro_batch_size}")
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        fail("train.use_dynamic_batch_size", "use_dynamic_batch_size needs max_tokens_per_gpu")
    if r.over_sampling_batch_size and r.rollout_batch_size and r.over_sampling_batch_size < r.rollout_batch_size:
        fail("rollout.over_sampling_batch_size",
             f"{r.over_sampling_batch_size} is smaller than rollout_batch_size {r.rollout_batch_size}",
             "rollout.rollout_batch_size")
    if a.kl_coef and (a.use_kl_loss or a.kl_loss_coef):
        fail("algorithm.kl_coef", "kl_coef (reward penalty) and use_kl_loss/kl_loss_coef (loss term) are exclusive",
             "algorithm.use_kl_loss", "algorithm.kl_loss_coef")
    if a.kl_loss_coef and not a.use_kl_loss:
        fail("algorithm.kl_loss_coef", "kl_loss_coef is set but use_kl_loss is false")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        fail("algorithm.eps_clip_c", f"dual-clip constant must be > 1, got {a.eps_clip_c}")
    if a.custom_tis_function_path and not a.use_tis:
        fail("algorithm.custom_tis_function_path", "is applied with use_tis: set --use-tis too")
    if a.use_tis and a.tis_clip_low >= a.tis_clip:
        fail("algorithm.tis_clip_low", f"tis_clip_low {a.tis_clip_low} must be below tis_clip {a.tis_clip}")
    if a.advantage_estimator.startswith("reinforce_plus_plus") and not a.normalize_advantages:
        fail("algorithm.advantage_estimator", f"{a.advantage_estimator} needs normalize_advantages: true")
    # the RL schedule, then SFT's own where sft_* fields override it (named by the field that was set)
    for t, name in ((config.train, {}), (config.sft_train(), _SFT_SCHEDULE_FIELDS)):
        def field(n: str, name: dict[str, str] = name) -> str:
            return name.get(n, f"train.{n}")

        if t.min_lr > t.lr:
            fail(field("min_lr"), f"min_lr {t.min_lr} is above lr {t.lr}", field("lr"))
        if t.lr_warmup_init > t.lr:
            fail("train.lr_warmup_init", f"lr_warmup_init {t.lr_warmup_init} is above lr {t.lr}", field("lr"))
        if t.lr_decay_iters is not None and t.lr_warmup_iters >= t.lr_decay_iters:
            fail(field("lr_warmup_iters"), f"lr_warmup_iters {t.lr_warmup_iters} must be below lr_decay_iters "
                 f"{t.lr_decay_iters}", "train.lr_decay_iters")
        if t.lr_decay_style == "WSD" and t.lr_wsd_decay_iters is None:
            fail(field("lr_decay_style"), "WSD needs lr_wsd_decay_iters (length of the decay phase)")
    check_async_mode(config, fail)
    _check_share_gpu(config, fail)
    if config.sync.async_mode != "off" and config.cluster.colocate:
        fail("sync.async_mode", f"async ({config.sync.async_mode}) generation needs separate train and rollout "
             "GPUs: it cannot be combined with colocate", "cluster.colocate")

    if (protocol := unknown_protocol(config.run.store)) is not None:
        fail("run.store", f"unknown storage protocol {protocol!r} in {config.run.store!r}: use a local path or an "
             "fsspec URL (s3://bucket/prefix, gs://..., memory://...)")
    context = config.rollout.rollout_max_context_len
    if context is not None and config.data.rollout_max_prompt_len > context - 1:
        fail("data.rollout_max_prompt_len", f"{config.data.rollout_max_prompt_len} must be at most "
             f"rollout_max_context_len - 1 = {context - 1}, so that a prompt leaves room for at least one generated "
             "token to compute the loss (slime)", "rollout.rollout_max_context_len")
    # checkpoint.save_interval without checkpoint.save: a stage saves to {store}/{run_id}/<stage>/checkpoint
    # (slime.preflight.place_outputs), which fails there when the run has no id
    if config.data.rollout_max_prompt_len and not config.checkpoint.hf_checkpoint:
        if "data.rollout_max_prompt_len" not in where and context is not None:
            fail("rollout.rollout_max_context_len", f"drops prompts longer than rollout_max_context_len - 1 = "
                 f"{context - 1} tokens (slime's default rollout_max_prompt_len), which needs "
                 "checkpoint.hf_checkpoint for its tokenizer")
        fail("data.rollout_max_prompt_len", "needs checkpoint.hf_checkpoint for its tokenizer")
    if config.engine.engine == "builtin" and (dtype := config.sglang_arg("dtype")) is not None \
            and str(dtype) not in DTYPES:
        fail("sglang.dtype", f"{dtype!r} is not a dtype the built-in engine runs in; one of {sorted(DTYPES)}")
    if config.sglang or config.router:
        for section, check in (("sglang", check_sglang_args), ("router", check_router_args)):
            for key, value in getattr(config, section).items():
                try:
                    check({key: value})
                except ConfigError as exc:
                    raise ConfigError(f"{where.get(f'{section}.{key}', 'config')}: {exc}") from None
    if r.rollout_http_timeout_s is not None:
        try:
            router_s = request_timeout_s(config.router)
        except ConfigError as exc:
            fail("router.request_timeout_secs", str(exc))
        if r.rollout_http_timeout_s < router_s:
            fail("rollout.rollout_http_timeout_s", f"{r.rollout_http_timeout_s:g} s is below the router's request "
                 f"timeout, {router_s:g} s (--sglang-router-request-timeout-secs; sglang-router's default when not "
                 "given): generations the router allows would be cut here, unretried, while the engine goes on "
                 "generating. To bound generations lower the router's timeout; unset, this follows it",
                 "router.request_timeout_secs")
    if config.run.debug_rollout_only and config.run.debug_train_only:
        fail("run.debug_train_only", "debug_rollout_only and debug_train_only exclude each other (slime)",
             "run.debug_rollout_only", "run.load_debug_rollout_data")
    if config.run.debug_train_only and not config.run.load_debug_rollout_data:
        fail("run.debug_train_only", "needs load_debug_rollout_data (--load-debug-rollout-data): the stored rollout "
             "shard sets to train on, e.g. runs/RUN/rollout/{rollout_id:06d}")
    t = config.train
    if config.engine.rollout_external_engine_addrs:
        try:
            external_engine_urls(config.engine.rollout_external_engine_addrs)
        except ConfigError as exc:
            fail("engine.rollout_external_engine_addrs", str(exc))
        if config.engine.use_fault_tolerance:
            fail("engine.use_fault_tolerance", "restarts engines this run started: external engines "
                 "(rollout_external_engine_addrs) cannot be restarted here", "engine.rollout_external_engine_addrs")
    _check_load_flags(config, fail)
    if config.cluster.release_train:
        if not config.checkpoint.save or config.checkpoint.no_save_optim:
            fail("cluster.release_train", "the recreated train ranks resume from a full checkpoint of each rollout: "
                 "set checkpoint.save and leave no_save_optim off", "checkpoint.no_save_optim")
        if config.sync.async_mode != "off":
            fail("cluster.release_train", "async mode trains while generating: the train ranks cannot be released",
                 "sync.async_mode")
    if t.balance_by_flops and not t.use_dynamic_batch_size:
        fail("train.balance_by_flops", "balances the micro-batches of dynamic batching: set use_dynamic_batch_size "
             "and max_tokens_per_gpu")
    if t.use_stateless_adam and t.optimizer != "adam":
        fail("train.use_stateless_adam", f"stateless Adam needs optimizer adam, not {t.optimizer}", "train.optimizer")
    if t.use_stateless_adam and not config.checkpoint.no_save_optim:
        fail("train.use_stateless_adam", "stateless Adam keeps no moments to save: set no_save_optim "
             "(--no-save-optim), as slime requires")
    if a.ref_update_interval and not (a.use_kl_loss or a.kl_coef):
        fail("algorithm.ref_update_interval", "there is no reference model to update: it is built for use_kl_loss "
             "or kl_coef")
    _check_opd(config, fail)
    if a.disable_compute_advantages_and_returns:
        given = [n for n in ("use_kl_loss", "kl_coef", "custom_advantage_function_path", "normalize_advantages",
                             "keep_old_actor", "use_opd")
                 if getattr(a if n != "custom_advantage_function_path" else t, n)]
        if given:
            fail("algorithm.disable_compute_advantages_and_returns", f"{given[0]} needs the reference/old log-prob "
                 "passes or the advantage computation that this flag turns off")
    if config.run.memory_recorder == "memray" and config.run.record_memory_history and \
            config.run.memory_snapshot_num_steps is None:
        fail("run.memory_recorder", "memray needs memory_snapshot_num_steps (when to stop the tracker), as in slime")
    if config.data.disable_rollout_global_dataset and \
            config.rollout.rollout_function_path == type(r).model_fields["rollout_function_path"].default:
        fail("data.disable_rollout_global_dataset", "the default rollout draws prompts from the global dataset (slime "
             "asserts it too): set rollout_function_path to a rollout function that makes its prompts")
    if config.sft.loss_mask_type == "qwen3_5":
        fail("sft.loss_mask_type", "qwen3_5 (offset mapping over the rendered text) is not built here: use qwen, "
             "qwen3 or distill_qwen, or a template with {% generation %} blocks")
    if config.run.load_debug_rollout_data_subsample and not config.run.load_debug_rollout_data:
        fail("run.load_debug_rollout_data_subsample", "subsamples stored rollouts: set load_debug_rollout_data")
    if config.run.ci_save_grad_norm and config.run.ci_load_grad_norm:
        fail("run.ci_load_grad_norm", "set ci_save_grad_norm or ci_load_grad_norm, not both", "run.ci_save_grad_norm")
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
    if config.lora.enabled:
        for name in ("only_train_params_name_list", "freeze_params_name_list"):
            if getattr(config.train, name):
                fail(f"train.{name}", "LoRA trains the adapters only and freezes every base weight: partial "
                     "training lists do not apply (set lora_rank 0 to use them)", "lora.lora_rank")
    elif config.lora.lora_adapter_path:
        fail("lora.lora_adapter_path", "starting from an adapter needs LoRA on: set lora_rank (the adapter's rank)")
    if s.lora_sync == "adapter":
        _check_adapter_sync(config, fail)
    if config.rollout.rollout_data_transport == "nixl":
        fail("rollout.rollout_data_transport", "NIXL is not built here: rollout data reaches the trainer as an "
             "Arrow shard set in the store (object-store)")
    if config.run.custom_config_path:
        try:
            read_custom_config(config.run.custom_config_path)
        except ConfigError as exc:
            fail("run.custom_config_path", str(exc))
    refused = sorted(name for name in config.megatron if refusal(name))
    if refused:  # one of slime's own flags this project does not do: say why rather than pass it on
        name = refused[0]
        fail(f"megatron.{name}", f"slime's --{name.replace('_', '-')} is not supported here: {refusal(name)}")
    if int(config.megatron.get("virtual_pipeline_model_parallel_size") or 1) > 1:
        fail("megatron.virtual_pipeline_model_parallel_size", "virtual pipeline stages (interleaved 1F1B) are not "
             "supported by the Megatron backend: it runs one model chunk per rank (pipeline_model_parallel_size "
             "alone is supported)")
    cluster = config.cluster
    for field, why in option_problems(config.megatron,
                                      offload_train=cluster.colocate if cluster.offload_train is None
                                      else bool(cluster.offload_train),
                                      dynamic_batch=t.use_dynamic_batch_size):
        fail(field, why, *(name for name in ("megatron.cuda_graph_impl", "megatron.enable_cuda_graph", "cluster.colocate",
                                             "cluster.offload") if name != field))
    typed = sorted(set(config.megatron) & set(FIELD_SECTION))
    if typed:  # e.g. `megatron: {lr_decay_style: cosine}`: the typed field is the one the trainer reads
        name = typed[0]
        fail(f"megatron.{name}", f"{name} is a typed field: set it as {FIELD_SECTION[name]}.{name} "
             f"(--{name.replace('_', '-')}), not in the megatron pass-through section")
    for field, why in launch_problems(config.megatron):  # Megatron-LM launch flags refused or mis-valued
        fail(field, why)
    if config.megatron:
        unknown = sorted(set(config.megatron) - megatron_flag_names() - LAUNCH_ACCEPTED)
        if unknown:
            name = unknown[0]
            hint = f"; {RAY_CLI[name]}" if name in RAY_CLI else _suggest(
                name, [*FIELD_SECTION, *megatron_flag_names(), *LAUNCH]).replace("_", "-")
            fail(f"megatron.{name}", f"unknown option --{name.replace('_', '-')}{hint}")


@functools.cache
def megatron_flag_names() -> frozenset[str]:
    """Megatron options this project accepts: fields of megatron-core's config dataclasses plus the
    scheduler/model-shape flags Megatron's own parser defines outside them."""

    with warnings.catch_warnings():  # megatron warns at import when Transformer Engine / apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer import TransformerConfig

    names = {f.name for cls in (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig)
             for f in dataclasses.fields(cls)}
    names |= {
        "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by", "vocab_size",
        "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_init",
        "start_weight_decay", "end_weight_decay", "weight_decay_incr_style", "untie_embeddings_and_output_weights",
        "position_embedding_type", "rotary_base", "use_rotary_position_embeddings", "normalization",
        "swiglu", "disable_bias_linear", "add_qkv_bias", "group_query_attention", "num_query_groups",
        "norm_epsilon", "transformer_impl", "recompute_activations", "distributed_backend",
        "sequence_parallel", "use_distributed_optimizer", "ckpt_format", "use_precision_aware_optimizer",
        "use_pytorch_profiler", "profile_step_start", "profile_step_end",  # slime's profiling (profile.py)
        "padded_vocab_size",  # slime's model vocabulary size (convert.vocab_padding)
    }
    return frozenset(names)
