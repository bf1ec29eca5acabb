"""One Megatron rank of the policy trainer, run as a Ray actor (`TrainGroup` starts one per rank).

Per rollout (`train`), each rank:

1. reads the rollout's shard set from the store (every rank reads it all: it is small, and the group
   reward normalisation needs whole groups), normalises rewards per group (`slime.algorithms.rewards`);
2. cuts the batch into `steps` optimizer steps of `global_batch_size` samples (or `num_steps_per_rollout`
   equal steps; a remainder is dropped, as in slime) and takes every dp-th sample of each step;
3. computes, over its share, the old log-probs (the ratio's denominator when a rollout has several steps;
   skipped when `can_reuse_log_probs` holds, as slime's can_reuse_log_probs_in_loss: the one step's loss
   uses its own forward's log-probs, detached, and reports the rollout metrics that read them), the
   reference log-probs when KL is used (`use_kl_loss` or `kl_coef`; the reference is a second, frozen
   model), the OPD teacher's log-probs with `use_opd` (a third, frozen model from `opd_teacher_load`), then
   advantages (`compute_advantages`; with OPD minus opd_kl_coef * (student - teacher log-prob) per token,
   `slime.algorithms.opd`; `whiten_over_dp` with `normalize_advantages`);
4. runs `train_step` per step and returns the mean of the steps' global metrics with slime's names.

Weights at `init`: the newest committed checkpoint under `save` (a resume: full training state, next
rollout id = its iteration + 1), else `load` (a full RL checkpoint resumes, less its optimizer and schedule
with --no-load-optim or its RNG with --no-load-rng; with --finetune, or a model-only one, e.g. a conversion
or SFT output, it only gives weights), else `ref_load`, else the HF checkpoint. Checkpoint
iteration = rollout id. Everything returned is a small JSON-able dict. Departures from slime: the
reference is a separate model rather than a CPU copy swapped in.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import resource
import time
from dataclasses import fields, replace
from typing import Any

from slime.backends.megatron.batching import balanced_partition, forward_flops
from slime.backends.megatron.hooks import load_megatron_hooks
from slime.config import Config
from slime.errors import ConfigError, DataFormatError
from slime.net import find_free_port
from slime.plugins import load_plugin_field
from slime.ray.ci_checks import check_ci, check_grad_norms, save_grad_norms

logger = logging.getLogger(__name__)

STAGE = "rl"


def steps_per_rollout(config: Config, num_samples: int) -> int:
    """Optimizer steps a rollout of `num_samples` samples is cut into."""
    t = config.train
    if t.num_steps_per_rollout:
        return t.num_steps_per_rollout
    if t.global_batch_size:
        if num_samples < t.global_batch_size:
            raise DataFormatError(f"the rollout has {num_samples} samples, fewer than global_batch_size "
                                  f"{t.global_batch_size}")
        return num_samples // t.global_batch_size
    return 1


def total_train_steps(config: Config) -> int | None:
    """Optimizer steps of the whole run (the LR schedule's length), when num_rollout is known."""
    r = config.rollout
    if not r.num_rollout or not r.rollout_batch_size:
        return None
    return r.num_rollout * steps_per_rollout(config, r.rollout_batch_size * r.n_samples_per_prompt)


def can_reuse_log_probs(config: Config, steps: int, hooks: Any) -> bool:
    """Whether the old-log-prob pass can be skipped: slime's can_reuse_log_probs_in_loss (one optimizer step per
    rollout, so the old policy is the one the loss runs; policy loss; no kl_coef, rollout log-probs as old,
    mismatch metrics, critic, old actor, OPD or GSPO), plus what reads old log-probs before the step here: the
    advantage and rollout-data-postprocess hooks and --log-correct-samples (per-sample log-probs)."""
    a = config.algorithm
    return (steps == 1 and a.loss_type == "policy_loss" and a.kl_coef == 0 and not a.use_rollout_logprobs
            and not a.get_mismatch_metrics and not a.keep_old_actor and a.advantage_estimator not in ("gspo", "ppo")
            and not a.use_opd and not config.run.log_correct_samples and hooks.advantage is None
            and hooks.rollout_data_postprocess is None)


def log_prob_stats(tokens: float, log_probs: float, abs_diff: float, abs_diff_tokens: float,
                   kl: float | None = None, entropy: float | None = None) -> dict[str, float]:
    """The rollout metrics read off the old log-probs, from their sums over the trained tokens of all ranks:
    mean log-prob, mean |old - rollout| (over the samples with rollout log-probs), KL to the reference and
    entropy (each where given). One formula for the recomputed pass (`_arrays`) and the reused one."""
    tokens = max(tokens, 1.0)
    stats = {"rollout/log_probs": log_probs / tokens}
    if abs_diff_tokens > 0:
        stats["train/train_rollout_logprob_abs_diff"] = abs_diff / abs_diff_tokens
    if kl is not None:
        stats["rollout/kl"] = kl / tokens
    if entropy is not None:
        stats["rollout/entropy"] = entropy / tokens
    return stats


def reused_log_prob_stats(row: dict[str, float], with_kl: bool, with_entropy: bool) -> dict[str, float]:
    """The rollout metrics of the skipped old-log-prob pass (`log_prob_stats`), from the REUSED_PREFIX sums a
    `reuse_log_probs` step reports; pops those sums from `row`."""
    from slime.backends.megatron.train import REUSED_PREFIX

    sums = {k[len(REUSED_PREFIX):]: row.pop(k) for k in list(row) if k.startswith(REUSED_PREFIX)}
    return log_prob_stats(sums["tokens"], sums["log_probs"], sums["abs_diff"], sums["abs_diff_tokens"],
                          kl=sums["kl"] if with_kl else None, entropy=sums["entropy"] if with_entropy else None)


def rank_share(samples: list[Any], steps: int, rank: int, world_size: int,
               workloads: list[float] | None = None) -> list[list[Any]]:
    """This rank's samples of each step: step k is `samples[k*G:(k+1)*G]`, rank r takes every
    world_size-th sample of it starting at r; with `workloads` (slime's --balance-data: one estimated cost
    per sample) rank r takes group r of the step's Karmarkar-Karp partition into equal-count groups."""

    size = len(samples) // steps
    if size % world_size:
        raise ConfigError(f"{size} samples per optimizer step cannot be split over {world_size} data-parallel "
                          "ranks; make global_batch_size (or the rollout size / num_steps_per_rollout) a multiple "
                          "of the number of data-parallel ranks (train actors / (TP x PP))")
    if workloads is None:
        return [samples[k * size:(k + 1) * size][rank::world_size] for k in range(steps)]
    return [[samples[k * size + i] for i in balanced_partition(workloads[k * size:(k + 1) * size], world_size)[rank]]
            for k in range(steps)]


def subsample_rollout(samples: list[Any], ratio: float, group_size: int) -> list[Any]:
    """slime's --load-debug-rollout-data-subsample: about `ratio` of the rows, the first half and the last
    half of them; here in whole groups of `group_size`, which group reward normalisation needs."""
    groups = len(samples) // group_size
    keep = int(groups * ratio)
    if keep == 0:
        raise DataFormatError(f"load_debug_rollout_data_subsample {ratio} keeps no group of the {groups} stored")
    head, tail = keep // 2, keep - keep // 2
    return samples[:head * group_size] + samples[len(samples) - tail * group_size:]


def apply_train_data(samples: list[Any], data: Any, source: str) -> tuple[list[float], list[float]]:
    """Write slime's `train_data` dict (what its samples-to-train-data conversion returns) back onto the samples
    the trainer reads; (raw rewards, rewards). `rewards` is required; `raw_reward` defaults to it."""
    if not isinstance(data, dict) or "rewards" not in data:
        raise DataFormatError(f"custom_convert_samples_to_train_data_path {source}: must return slime's train_data "
                              f"dict with at least 'rewards', got {type(data).__name__}"
                              f"{' with keys ' + str(sorted(data)) if isinstance(data, dict) else ''}")
    for key in ("rewards", "raw_reward", "tokens", "response_lengths", "loss_masks", "rollout_log_probs"):
        if key in data and len(data[key]) != len(samples):
            raise DataFormatError(f"custom_convert_samples_to_train_data_path {source}: train_data[{key!r}] has "
                                  f"{len(data[key])} entries for {len(samples)} samples")
    for i, sample in enumerate(samples):
        if "tokens" in data:
            sample.tokens = [int(t) for t in data["tokens"][i]]
        if "response_lengths" in data:
            sample.response_length = int(data["response_lengths"][i])
        if "loss_masks" in data:
            sample.loss_mask = [int(v) for v in data["loss_masks"][i]]
        if "rollout_log_probs" in data:
            sample.rollout_log_probs = [float(v) for v in data["rollout_log_probs"][i]]
        if sample.loss_mask is not None and len(sample.loss_mask) != sample.response_length:
            raise DataFormatError(f"custom_convert_samples_to_train_data_path {source}: sample {i} has a loss mask "
                                  f"of {len(sample.loss_mask)} for response length {sample.response_length}")
    rewards = [float(r) for r in data["rewards"]]
    return [float(r) for r in data.get("raw_reward", rewards)], rewards


def named_params(models: list[Any]) -> dict[str, Any]:
    """The parameters of model chunks by `chunk.name`, without wrapper prefixes (DDP, Float16Module:
    `module.`), so an unwrapped copy of the model has the same names."""
    out = {}
    for chunk, model in enumerate(models):
        for name, param in model.named_parameters():
            while name.startswith("module."):
                name = name[len("module."):]
            out[f"{chunk}.{name}"] = param
    return out


def copy_weights(source: list[Any] | dict[str, Any], target: list[Any]) -> None:
    """Copy the parameters of model chunks `source` (or a `snapshot` of them) into `target`."""
    import torch

    src = source if isinstance(source, dict) else named_params(source)
    dst = named_params(target)
    if src.keys() != dst.keys():
        raise ConfigError(f"cannot copy weights between different models: {sorted(src.keys() ^ dst.keys())[:3]}")
    with torch.no_grad():
        for name, param in dst.items():
            param.copy_(src[name])


def snapshot(models: list[Any]) -> dict[str, Any]:
    """A CPU copy of the models' parameters (slime keeps its model copies on the host as well)."""
    return {name: param.detach().to("cpu", copy=True) for name, param in named_params(models).items()}


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for row in rows for name in row})
    return {name: sum(row.get(name, 0.0) for row in rows) / len(rows) for name in names}


class TrainActor:
    """A Megatron rank: `init`, `train`, `save`, `offload`/`onload`, `update_weights`.

    Construct with the config as a JSON dict (`Config.model_dump(mode="json")`), this rank and the
    world size; rank 0's `init_method()` gives the address every rank passes to `init`.
    """

    def __init__(self, config: dict[str, Any], rank: int, world_size: int,
                 remote_fields: dict[str, str] | None = None) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config = Config.model_validate(config)
        self.rank, self.world_size = rank, world_size
        # train ranks on other nodes than the driver, a remote store: the remote URLs of the checkpoint fields,
        # staged on this node by `init` (slime/storage/node_staging.py); None: the config's paths are readable here
        self.remote_fields = remote_fields
        self.node_staging: Any = None
        self.models: list[Any] = []
        self.ref_models: list[Any] | None = None
        self.teacher_models: list[Any] | None = None  # --use-opd --opd-type megatron: the frozen teacher
        self.loaded_extra_state: dict[str, Any] = {}
        self.offloaded = False
        self.parking: Any = None  # slime.offload.HostParking: the optimizer state's pinned twins (colocated offload)
        self.syncer: Any = None  # slime.sync.WeightSyncer, made by the first update_weights (rank 0)
        self._synced_once = False  # ranks > 0: whether adapter sync's first (base-writing) sync is past
        self.hooks: Any = None  # slime.backends.megatron.hooks.MegatronHooks, loaded by init
        # --- LoRA (docs/lora.md): adapters on the frozen base; the KL reference is that base (+ starting adapters)
        self.lora_spec: Any = None  # slime.backends.megatron.lora.LoraSpec when lora_rank > 0
        self.lora_reference: Any = None  # starting adapters of the reference, None: the base alone
        self.lora_kl = False  # the reference is computed in self.models (no ref_models)
        self.profiler: Any = None  # slime.backends.megatron.profile.TrainProfiler, made by init
        # --keep-old-actor: CPU copies of the weights the engines generate with (old) and were last given (rollout)
        self.old_weights: dict[str, Any] | None = None
        self.rollout_weights: dict[str, Any] | None = None
        self.reusing_log_probs: bool | None = None  # the last rollout's can_reuse_log_probs (logged when it changes)
        self.saver: Any = None  # slime.backends.megatron.async_save.AsyncSaver with --async-save, made by the first save
        self._loop = asyncio.new_event_loop()  # one loop for the syncer's whole life

    def init_method(self) -> str:
        """`tcp://IP:PORT` on this actor's node, for torch.distributed (called on rank 0)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{find_free_port('0.0.0.0')}"

    def init(self, init_method: str) -> int:
        """Join the process group, build model/optimizer/scheduler, load weights; the first rollout id."""
        from transformers import AutoTokenizer

        from slime.backends.megatron.bridge import (
            build_model,
            init_megatron,
            make_bridge,
            model_parallel_sizes,
        )
        from slime.backends.megatron.freeze import freeze_callback
        from slime.backends.megatron.lora import LoraSpec, lora_callback
        from slime.backends.megatron.optimizer import build_optimizer_and_scheduler
        from slime.stages.convert import megatron_dtype, vocab_padding

        if self.remote_fields:  # this node's own copies (one download per node), saves uploaded from each node
            from slime.storage.node_staging import stage_on_node

            self.config, self.node_staging = stage_on_node(self.config, self.remote_fields)
        c = self.config
        c.require("checkpoint.hf_checkpoint", stage=STAGE)
        if c.algorithm.advantage_estimator == "ppo":
            raise ConfigError("algorithm.advantage_estimator 'ppo' needs a critic, which the Ray train group does "
                              "not run yet; use grpo, gspo, cispo or reinforce_plus_plus(_baseline)")
        if c.algorithm.loss_type != "policy_loss":
            raise ConfigError(f"algorithm.loss_type {c.algorithm.loss_type!r}: the RL train actor trains "
                              "policy_loss only")
        self.hooks = load_megatron_hooks(c.as_namespace())  # signature-checked before any process group
        tp, pp = model_parallel_sizes(c.megatron, self.world_size)
        init_megatron(seed=c.run.seed, tensor_parallel=tp, pipeline_parallel=pp, rank=self.rank,
                      world_size=self.world_size, init_method=init_method,
                      timeout_minutes=c.cluster.distributed_timeout_minutes, megatron=c.megatron)
        import torch

        if c.cluster.share_gpu and torch.cuda.is_available():  # the engine holds the rest of this GPU
            torch.cuda.set_per_process_memory_fraction(c.cluster.gpu_fractions()[0])
        if self.hooks.init is not None:
            self.hooks.init(c.as_namespace())
        from slime.backends.megatron.profile import TrainProfiler

        self.profiler = TrainProfiler(c, self.rank)  # memory history from here, as slime's
        hf_dir = c.checkpoint.hf_checkpoint
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.bridge = make_bridge(hf_dir, megatron_dtype(c), vocab_padding(c, hf_dir), c.megatron)
        self.lora_spec = LoraSpec.from_config(c)
        self.models = build_model(self.bridge, wrap_with_ddp=True,
                                  use_distributed_optimizer=c.train.use_distributed_optimizer,
                                  post_create=lora_callback(self.lora_spec) or freeze_callback(
                                      c.train.only_train_params_name_list, c.train.freeze_params_name_list))
        self.optimizer, self.scheduler = build_optimizer_and_scheduler(self.models, c, total_train_steps(c))
        if self.lora_spec is not None:
            return self._load_lora_weights()
        start = self._load_weights()
        if c.algorithm.use_kl_loss or c.algorithm.kl_coef:
            self.ref_models = build_model(self.bridge)
            self._load_reference()
        if c.algorithm.use_opd:  # opd_type megatron (config refuses the rest): the teacher, frozen like the reference
            self.teacher_models = build_model(self.bridge)
            self._load_teacher()
        if c.algorithm.keep_old_actor:  # slime: the old actor starts as the loaded policy
            self.old_weights = snapshot(self.models)
            if c.sync.update_weights_interval == 1:
                self.rollout_weights = self.old_weights
        self.profiler.on_init_end()
        return start

    def _load_lora_weights(self) -> int:
        """LoRA: the base, then the adapters (a resume's, else the starting ones); the KL reference stays in
        this model (slime/backends/megatron/lora_weights.py says which base, adapters and reference)."""
        from slime.backends.megatron import lora_weights
        from slime.backends.megatron.checkpoint import (
            latest_checkpoint,
            load_checkpoint,
            read_checkpoint_manifest,
        )

        c = self.config
        resume = latest_checkpoint(c.checkpoint.save) if c.checkpoint.save else None
        start_from = lora_weights.lora_checkpoint(c.checkpoint.load) if resume is None else None
        partial = {}  # --no-load-optim / --no-load-rng: for the start from `load`, as in _load_weights
        if start_from and read_checkpoint_manifest(start_from).metadata.get("stage") == STAGE and \
                read_checkpoint_manifest(start_from).metadata.get("training_state") and not c.checkpoint.finetune:
            resume = start_from  # a full RL checkpoint as --load resumes, as without LoRA
            partial = {"load_optim": not c.checkpoint.no_load_optim, "load_rng": not c.checkpoint.no_load_rng}
        self.lora_kl = bool(c.algorithm.use_kl_loss or c.algorithm.kl_coef)
        if resume is None:
            self.lora_reference = lora_weights.start_weights(self.bridge, self.models, c)
            self.optimizer.reload_model_params()
            return 0
        lora_weights.load_base(self.bridge, self.models, lora_weights.recorded_base(resume))
        if self.lora_kl:
            self.lora_reference = lora_weights.reference_snapshot(self.models, c)
        state = load_checkpoint(self.models, resume, self.optimizer, self.scheduler, **partial)
        self.loaded_extra_state = state.extra_state
        logger.info("rank %d: resumed LoRA adapters from %s, next rollout %d", self.rank, resume, state.iteration + 1)
        return state.iteration + 1

    def _load_weights(self) -> int:
        from slime.backends.megatron.checkpoint import (
            latest_checkpoint,
            load_checkpoint,
            load_model_checkpoint,
            read_checkpoint_manifest,
            reference_checkpoint,
            resolve_checkpoint,
        )

        ck = self.config.checkpoint
        resume = latest_checkpoint(ck.save) if ck.save else None
        partial = {}  # Megatron's --no-load-optim / --no-load-rng: for the start from `load`, never an own resume
        if resume is None and ck.load:
            path = resolve_checkpoint(ck.load)
            meta = read_checkpoint_manifest(path).metadata
            if meta.get("stage") == STAGE and meta.get("training_state") and not ck.finetune:
                resume = path
                partial = {"load_optim": not ck.no_load_optim, "load_rng": not ck.no_load_rng}
            else:
                load_model_checkpoint(self.models, path)
                # bf16/fp16: the optimizer's fp32 main copies were taken from the weights at build time; without
                # this the first step would write those (Megatron's random init) back over the loaded model
                self.optimizer.reload_model_params()
                logger.info("rank %d: weights from %s (model only%s)", self.rank, path,
                            ", --finetune" if ck.finetune else "")
                return 0
        if resume is not None:
            stage = read_checkpoint_manifest(resume).metadata.get("stage")
            if stage != STAGE:
                raise ConfigError(f"{resume} is a checkpoint of stage {stage!r}, not an RL checkpoint: give RL its "
                                  "own --save directory and pass the other checkpoint as --load or --ref-load")
            state = load_checkpoint(self.models, resume, self.optimizer, self.scheduler, **partial)
            self.loaded_extra_state = state.extra_state
            logger.info("rank %d: resumed from %s, next rollout %d", self.rank, resume, state.iteration + 1)
            return state.iteration + 1
        if ck.ref_load:
            load_model_checkpoint(self.models, reference_checkpoint(ck))
        else:
            self.bridge.load_weights(self.models, ck.hf_checkpoint)
        self.optimizer.reload_model_params()  # the main params from the loaded weights, as above
        return 0

    def _load_reference(self) -> None:
        """The KL reference: `ref_load`; else the policy RL starts from (`load`, e.g. the pipeline's SFT
        checkpoint, also on a resume); else `hf_checkpoint`. (The GPU pipeline's first run took the untrained
        HF weights as reference while RL started from SFT: KL to the reference read 6.0 at step 0.)"""
        from slime.backends.megatron.checkpoint import (
            load_model_checkpoint,
            reference_checkpoint,
            resolve_checkpoint,
        )

        ck = self.config.checkpoint
        if ck.ref_load:
            load_model_checkpoint(self.ref_models, reference_checkpoint(ck))
        elif ck.load:
            load_model_checkpoint(self.ref_models, resolve_checkpoint(ck.load))
        else:
            self.bridge.load_weights(self.ref_models, ck.hf_checkpoint)
        for model in self.ref_models:
            model.eval()

    def _load_teacher(self) -> None:
        """The on-policy distillation teacher: `opd_teacher_load` (its iteration `opd_teacher_ckpt_step` when set),
        loaded into a model of the student's architecture, as slime loads it into the student's Megatron model.
        A checkpoint of another architecture or vocabulary is refused: OPD compares the two models' log-probs
        of the same token ids."""
        from slime.backends.megatron.checkpoint import (
            CheckpointMismatchError,
            load_model_checkpoint,
            read_checkpoint_manifest,
            teacher_checkpoint,
        )

        path = teacher_checkpoint(self.config.checkpoint)
        hf = read_checkpoint_manifest(path).metadata.get("hf_config") or {}
        student_vocab = self.bridge.hf_config.vocab_size
        if hf.get("vocab_size") not in (None, student_vocab):
            raise ConfigError(f"checkpoint.opd_teacher_load {path}: the teacher's vocabulary has {hf['vocab_size']} "
                              f"tokens, the student's {student_vocab}: a Megatron OPD teacher must share the "
                              "student's tokenizer and architecture")
        try:
            load_model_checkpoint(self.teacher_models, path)
        except CheckpointMismatchError as exc:
            raise ConfigError(f"checkpoint.opd_teacher_load: a Megatron OPD teacher is loaded into a model of the "
                              f"student's architecture (as slime does), and this one differs: {exc}") from exc
        for model in self.teacher_models:  # scored under no_grad, never stepped: frozen, as offload parks it
            model.eval()
            model.requires_grad_(False)
        logger.info("rank %d: OPD teacher from %s", self.rank, path)

    def extra_state(self) -> dict[str, Any]:
        """The `extra_state` of the checkpoint `init` resumed from ({} when it did not resume)."""
        return self.loaded_extra_state

    # ------------------------------------------------------------------------- train

    def train(self, rollout_id: int, uri: str) -> dict[str, float]:
        """Train on the rollout shard set at `uri`; global metrics (identical on every rank)."""
        from megatron.core import parallel_state

        from slime.backends.megatron.train import StepSettings, train_step
        from slime.storage import read_samples

        c = self.config
        t0 = time.monotonic()
        if self.saver is not None:  # commits the background save once every rank has written its files
            self.saver.poll()
        samples = read_samples(uri, c.run.storage_options or None)
        if not samples:
            raise DataFormatError(f"{uri}: the rollout shard set holds no samples")
        if c.run.load_debug_rollout_data and c.run.load_debug_rollout_data_subsample:
            samples = subsample_rollout(samples, c.run.load_debug_rollout_data_subsample,
                                        c.rollout.n_samples_per_prompt)
        raw, rewards = self._train_inputs(samples, uri)
        for sample, reward in zip(samples, rewards, strict=True):
            sample.metadata["normalized_reward"] = reward
        steps = steps_per_rollout(c, len(samples))
        workloads = None
        if c.train.balance_data:
            workloads = [self._flops(len(s.tokens)) for s in samples]
        # data-parallel shares: the ranks of one tensor/pipeline-parallel group train on the same samples
        shares = rank_share(samples, steps, parallel_state.get_data_parallel_rank(),
                            parallel_state.get_data_parallel_world_size(), workloads)
        mine = [s for share in shares for s in share]
        t1 = time.monotonic()
        reuse = (not c.algorithm.disable_compute_advantages_and_returns
                 and can_reuse_log_probs(c, steps, self.hooks))
        if reuse != self.reusing_log_probs:
            self.reusing_log_probs = reuse
            logger.info("rank %d rollout %d: old log-probs %s", self.rank, rollout_id,
                        "not recomputed: one optimizer step per rollout, the loss uses its own log-probs, detached "
                        "(slime's can_reuse_log_probs_in_loss)" if reuse else "recomputed before training")
        arrays, stats = self._arrays(rollout_id, mine, reuse)
        t2 = time.monotonic()
        settings = StepSettings.from_config(c)
        settings.reuse_log_probs = reuse
        if c.train.balance_by_flops:  # slime: micro-batches of even estimated FLOPs
            settings.workload = self._flops
        rows, start = [], 0
        vocab = self.bridge.hf_config.vocab_size
        pad = self.tokenizer.pad_token_id or 0
        for step_id, share in self.profiler.iterate("train_actor", enumerate(shares)):
            part = _slice_arrays(arrays, start, start + len(share))
            start += len(share)
            if self.hooks.before_train_step is not None:
                self.hooks.before_train_step(c.as_namespace(), rollout_id, step_id, self.models, self.optimizer,
                                             self.scheduler)
            if c.train.use_stateless_adam:  # slime's StatelessAdam: each step's moments start from zero
                from slime.backends.megatron.optimizer import reset_optimizer_states

                reset_optimizer_states(self.optimizer)
            rows.append(train_step(self.models, self.optimizer, share, settings, vocab_size=vocab,
                                   pad_token_id=pad, arrays=part))
            self.scheduler.step(1)
        if c.train.reset_optimizer_states:
            from slime.backends.megatron.optimizer import reset_optimizer_states

            reset_optimizer_states(self.optimizer)
        t3 = time.monotonic()
        self.profiler.step(rollout_id)
        if reuse:  # one step: its forward's log-probs are the old policy's
            stats.update(reused_log_prob_stats(rows[0], with_kl=arrays.ref_log_probs is not None,
                                               with_entropy=c.algorithm.use_rollout_entropy))
        metrics = {f"train/{k}": v for k, v in _mean_metrics(rows).items()}
        interval = c.algorithm.ref_update_interval
        if interval and self.ref_models and (rollout_id + 1) % interval == 0:  # slime: the reference := the actor
            copy_weights(self.models, self.ref_models)
            metrics["train/ref_updated"] = 1.0
            logger.info("rank %d rollout %d: reference model updated from the actor", self.rank, rollout_id)
        metrics.update(stats)
        self._ci_checks(rollout_id, rows, metrics)
        if self.lora_spec is not None:
            from slime.backends.megatron.lora import count_parameters

            metrics.update({"lora/rank": float(self.lora_spec.rank), "lora/peak_memory_bytes": _peak_memory_bytes(),
                            **{f"lora/{k}_params": float(v) for k, v in count_parameters(self.models).items()}})
        metrics.update({"train/steps": float(steps), "train/samples": float(len(samples)),
                        "rollout/raw_reward": sum(raw) / len(raw),
                        "perf/read_time": t1 - t0, "perf/log_probs_time": t2 - t1, "perf/train_step_time": t3 - t2,
                        "perf/train_time": t3 - t0, "rollout_id": float(rollout_id)})
        logger.info("rank %d rollout %d: %d steps, loss %.4f, grad_norm %.4f, %.2f s", self.rank, rollout_id,
                    steps, metrics.get("train/loss", math.nan), metrics.get("train/grad_norm", math.nan), t3 - t0)
        return metrics

    def _ci_checks(self, rollout_id: int, rows: list[dict[str, float]], metrics: dict[str, float]) -> None:
        """slime's --ci-test invariants and grad-norm save/compare (slime.ray.ci_checks); raise InvariantError."""

        run = self.config.run
        if run.ci_test:
            first = rows[0] if rows else {}
            check_ci(self.config.as_namespace(), rollout_id, first, metrics)
            logger.info("rank %d rollout %d: --ci-test invariants hold (logprob gap %.3g, first-step ppo_kl %.3g)",
                        self.rank, rollout_id, metrics.get("train/train_rollout_logprob_abs_diff", math.nan),
                        first.get("ppo_kl", math.nan))
        grad_norms = [row["grad_norm"] for row in rows]
        if run.ci_save_grad_norm and self.rank == 0:
            save_grad_norms(run.ci_save_grad_norm, rollout_id, grad_norms)
        elif run.ci_load_grad_norm:
            check_grad_norms(run.ci_load_grad_norm, rollout_id, grad_norms)

    def _train_inputs(self, samples: list[Any], uri: str) -> tuple[list[float], list[float]]:
        """(raw, trained) rewards of the batch: slime's --custom-convert-samples-to-train-data-path hook when set
        (`fn(args, samples) -> train_data`, slime's dict; what it returns replaces the samples' tokens, response
        lengths, loss masks and rollout log-probs where given, and its `rewards` are trained on as they are),
        else the group-normalised rewards."""
        path = self.config.reward.custom_convert_samples_to_train_data_path
        if not path:
            return self._rewards(samples, uri)

        convert = load_plugin_field(self.config.as_namespace(), "custom_convert_samples_to_train_data_path",
                                    ["args", "samples"], is_async=False)
        data = convert(self.config.as_namespace(), samples)
        return apply_train_data(samples, data, path)

    def _rewards(self, samples: list[Any], uri: str) -> tuple[list[float], list[float]]:
        """(raw, group-normalised) scalar rewards of the whole batch (every rank computes the same)."""
        import torch

        from slime.algorithms.rewards import custom_rewards, group_normalization_for, normalize_group_rewards

        c = self.config
        n = c.rollout.n_samples_per_prompt
        if len(samples) % n:
            raise DataFormatError(f"{uri}: {len(samples)} samples is not a whole number of groups of "
                                  f"n_samples_per_prompt={n}")
        for g in range(0, len(samples), n):
            if len({s.group_index for s in samples[g:g + n]}) != 1:
                raise DataFormatError(f"{uri}: samples {g}..{g + n - 1} are not one group (group_index differs); "
                                      "the rollout must store groups contiguously")
        args = c.as_namespace()
        if self.hooks is not None and self.hooks.reward_post_process is not None:  # slime: the plugin's rewards
            try:
                return custom_rewards(self.hooks.reward_post_process, args, samples,
                                      f"--custom-reward-post-process-path {c.reward.custom_reward_post_process_path}")
            except ValueError as exc:
                raise DataFormatError(f"{uri}: {exc}") from None
        raw = torch.tensor([float(s.get_reward_value(args)) for s in samples], dtype=torch.float32)
        how = group_normalization_for(c.algorithm.advantage_estimator, n,
                                      disable_rewards_normalization=c.algorithm.disable_rewards_normalization,
                                      disable_grpo_std_normalization=c.algorithm.disable_grpo_std_normalization)
        return raw.tolist(), normalize_group_rewards(raw, n, **how._asdict()).tolist()

    def _arrays(self, rollout_id: int, mine: list[Any], reuse: bool = False) -> tuple[Any, dict[str, float]]:
        """TrainArrays of this rank's samples (old/ref log-probs, advantages) and rollout-side metrics; with
        `reuse` (`can_reuse_log_probs`) no old log-probs, and the metrics that read them come from the step."""
        import torch

        from slime.algorithms.advantages import compute_advantages
        from slime.algorithms.kl import compute_approx_kl
        from slime.algorithms.opd import apply_opd_kl
        from slime.backends.megatron.logprobs import compute_log_probs
        from slime.backends.megatron.step_data import TrainArrays, split_rows, stack_rows
        from slime.backends.megatron.whiten import whiten_over_dp

        c, a, t = self.config, self.config.algorithm, self.config.train
        if a.disable_compute_advantages_and_returns:  # slime: the samples carry their advantages
            return TrainArrays(), {}
        batching = dict(vocab_size=self.bridge.hf_config.vocab_size, temperature=c.rollout.rollout_temperature,
                        micro_batch_size=t.micro_batch_size, use_dynamic_batch_size=t.use_dynamic_batch_size,
                        max_tokens_per_gpu=t.log_probs_max_tokens_per_gpu or t.max_tokens_per_gpu,
                        pad_token_id=self.tokenizer.pad_token_id or 0, pad_multiple=t.data_pad_size_multiplier,
                        chunk_size=t.log_probs_chunk_size, compile_scores=t.compile_scores,
                        fp32_logits=t.fp32_logits, profile=lambda items: self.profiler.iterate("train_log_probs", items),
                        workload=self._flops if t.balance_by_flops else None)
        old = entropies = None
        if not reuse:
            if self.hooks.before_log_prob is not None:
                self.hooks.before_log_prob(c.as_namespace(), self.models, "")
            current = None
            if self.old_weights is not None:  # slime's --keep-old-actor: old log-probs under the rollout's weights
                current = snapshot(self.models)
                copy_weights(self.old_weights, self.models)
            actor = compute_log_probs(self.models, mine, with_entropy=a.use_rollout_entropy, **batching)
            if current is not None:
                copy_weights(current, self.models)
            old, entropies = actor.log_probs, actor.entropies
        ref = None
        if self.ref_models:
            if self.hooks.before_log_prob is not None:
                self.hooks.before_log_prob(c.as_namespace(), self.ref_models, "ref_")
            ref = compute_log_probs(self.ref_models, mine, **batching).log_probs
        elif self.lora_kl:  # LoRA: the reference is the frozen base (+ starting adapters) of this model
            from slime.backends.megatron.lora import reference_adapters

            if self.hooks.before_log_prob is not None:
                self.hooks.before_log_prob(c.as_namespace(), self.models, "ref_")
            with reference_adapters(self.models, self.lora_reference):
                ref = compute_log_probs(self.models, mine, **batching).log_probs
        teacher = None
        if self.teacher_models:  # slime: the teacher's pass after the reference's, with the "teacher_" prefix
            if self.hooks.before_log_prob is not None:
                self.hooks.before_log_prob(c.as_namespace(), self.teacher_models, "teacher_")
            teacher = compute_log_probs(self.teacher_models, mine, **batching).log_probs
        _, mask = stack_rows(mine)
        # summed over ranks: |old - rollout| and its tokens, kl, log-probs, advantages, trained tokens, entropy,
        # teacher log-probs, OPD reverse KL
        sums = torch.zeros(9, dtype=torch.float64)
        sums[5] = float(mask.sum())
        if entropies is not None:  # --use-rollout-entropy
            sums[6] = float(stack_rows(mine, entropies)[0][mask].sum())
        kl = torch.zeros(mask.shape, dtype=torch.float32)  # with reuse, kl_coef is 0: advantages ignore it
        if old is not None:
            old_padded = stack_rows(mine, old)[0]
            if ref is not None:
                kl = compute_approx_kl(old_padded, stack_rows(mine, ref)[0], a.kl_loss_type)
                sums[2] = float(kl[mask].sum())
            sums[3] = float(old_padded[mask].sum())
            for sample, logp in zip(mine, old, strict=True):
                if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length:
                    m = torch.tensor(sample.loss_mask or [1] * sample.response_length, dtype=torch.bool)
                    diff = (logp - torch.tensor(sample.rollout_log_probs, dtype=torch.float32)).abs()
                    sums[0] += float(diff[m].sum())
                    sums[1] += float(m.sum())
        rewards = torch.tensor([s.metadata["normalized_reward"] for s in mine], dtype=torch.float32)
        hooks = self.hooks
        data = self._rollout_data(mine, old, ref, split_rows(kl, mine)) if hooks.advantage or \
            hooks.rollout_data_postprocess else {}
        if data and entropies is not None:
            data["entropy"] = entropies
        if data and teacher is not None:
            data["teacher_log_probs"] = teacher
        if hooks.advantage is not None:  # slime: replaces the estimator; sets advantages and returns
            hooks.advantage(c.as_namespace(), data)
            per_sample = [torch.as_tensor(v, dtype=torch.float32) for v in data["advantages"]]
        else:
            advantages, returns = compute_advantages(a.advantage_estimator, rewards, mask, kl=kl, kl_coef=a.kl_coef,
                                                     gamma=a.gamma, lambd=a.lambd)
            per_sample = split_rows(advantages, mine)
            if data:
                data["returns"] = None if returns is None else split_rows(returns, mine)
        if teacher is not None:  # slime: after the estimator (or the advantage hook), before whitening
            per_sample, reverse_kl = apply_opd_kl(per_sample, self._student_log_probs(mine, old), teacher,
                                                  a.opd_kl_coef)
            sums[7] = float(stack_rows(mine, teacher)[0][mask].sum())
            sums[8] = float(stack_rows(mine, reverse_kl)[0][mask].sum())
            if data:
                data["opd_reverse_kl"] = reverse_kl
        if hooks.rollout_data_postprocess is not None:  # slime: may rewrite advantages and loss masks
            data["advantages"] = per_sample
            hooks.rollout_data_postprocess(c.as_namespace(), rollout_id, data)
            per_sample = [torch.as_tensor(v, dtype=torch.float32) for v in data["advantages"]]
            for sample, m in zip(mine, data["loss_masks"], strict=True):
                sample.loss_mask = [int(v) for v in torch.as_tensor(m).tolist()]
            _, mask = stack_rows(mine)
        if a.normalize_advantages:
            per_sample = whiten_over_dp(mine, per_sample)
        sums[4] = float(stack_rows(mine, per_sample)[0][mask].sum())
        _all_reduce(sums)
        sums = sums.tolist()
        stats = {} if old is None else log_prob_stats(  # reused: the step reports these (reused_log_prob_stats)
            sums[5], sums[3], sums[0], sums[1], kl=sums[2] if ref is not None else None,
            entropy=sums[6] if entropies is not None else None)
        stats["rollout/advantages"] = sums[4] / max(sums[5], 1.0)
        if teacher is not None:  # slime's names; train/ as its loss reports it (the same detached values)
            stats["rollout/teacher_log_probs"] = sums[7] / max(sums[5], 1.0)
            stats["rollout/opd_reverse_kl"] = stats["train/opd_reverse_kl"] = sums[8] / max(sums[5], 1.0)
        if c.run.log_correct_samples:
            stats.update(self._correct_sample_stats(mine, old))
        return TrainArrays(advantages=per_sample, old_log_probs=old, ref_log_probs=ref), stats

    def _student_log_probs(self, mine: list[Any], old: list[Any]) -> list[Any]:
        """The student's log-probs OPD compares with the teacher's, as slime's: the engine's rollout log-probs with
        --use-rollout-logprobs, else the old log-probs just computed."""
        import torch

        if not self.config.algorithm.use_rollout_logprobs:
            return old
        for sample in mine:
            if sample.rollout_log_probs is None or len(sample.rollout_log_probs) != sample.response_length:
                raise DataFormatError(f"sample {sample.index}: --use-opd with --use-rollout-logprobs needs the "
                                      "engine's log-prob of every response token (rollout_log_probs)")
        return [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in mine]

    def _flops(self, length: int) -> float:
        """Estimated forward FLOPs of a sequence of `length` tokens under this model."""

        return forward_flops(length, self.bridge.hf_config)

    def _correct_sample_stats(self, mine: list[Any], old: list[Any]) -> dict[str, float]:
        """slime's --log-correct-samples over all ranks: of the responses with raw reward 1, the share in each
        quarter of rollout_max_response_len (correct_length/p25 ... p100) and their mean per-sample mean
        -log-prob of the response (correct_entropy, slime's name)."""
        import torch

        args = self.config.as_namespace()
        limit = self.config.rollout.rollout_max_response_len or max(s.response_length for s in mine)
        sums = torch.zeros(6, dtype=torch.float64)  # 4 quarters, correct samples, their mean -log-prob
        for sample, logp in zip(mine, old, strict=True):
            if float(sample.get_reward_value(args)) != 1:
                continue
            quarter = next(q for q in range(4) if sample.response_length <= limit * (q + 1) / 4 or q == 3)
            sums[quarter] += 1
            sums[4] += 1
            m = torch.tensor(sample.loss_mask or [1] * sample.response_length, dtype=torch.bool)
            sums[5] += float(-logp[m].sum()) / max(int(m.sum()), 1)
        _all_reduce(sums)
        total = float(sums[4]) + 1e-9
        out = {f"rollout/correct_length/p{25 * (q + 1)}": float(sums[q]) / total for q in range(4)}
        out["rollout/correct_entropy"] = float(sums[5]) / total if sums[4] else 0.0
        return out

    def _rollout_data(self, mine: list[Any], old: list[Any], ref: list[Any] | None, kl: list[Any]) -> dict[str, Any]:
        """This rank's samples as slime's `rollout_data` lists (what its advantage/post-process hooks get)."""
        import torch

        return {
            "rewards": [s.metadata["normalized_reward"] for s in mine],
            "raw_reward": [float(s.get_reward_value(self.config.as_namespace())) for s in mine],
            "log_probs": old, "ref_log_probs": ref, "kl": kl,
            "rollout_log_probs": [None if s.rollout_log_probs is None else
                                  torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in mine],
            "loss_masks": [torch.tensor(s.loss_mask or [1] * s.response_length, dtype=torch.int32) for s in mine],
            "response_lengths": [s.response_length for s in mine],
            "total_lengths": [len(s.tokens) for s in mine],
            "tokens": [torch.tensor(s.tokens) for s in mine],
        }

    # ------------------------------------------------------------------------- checkpoints, memory, sync

    def save(self, rollout_id: int, extra_state: dict[str, Any] | None = None, wait: bool = True) -> str:
        """Checkpoint iteration `rollout_id` under `save` (collective); its path (with node staging: its URL in
        the store, where every node uploaded its files). With --async-save the state is copied to host memory
        and written in the background: committed by a later `train` once every rank is done, or before this
        returns when `wait` (the run's last save, --release-train)."""
        from slime.backends.megatron.bridge import checkpoint_metadata
        from slime.backends.megatron.checkpoint import iteration_dir, save_checkpoint

        ck = self.config.checkpoint
        self.config.require("checkpoint.save", stage=STAGE)
        full = not ck.no_save_optim
        remote = self.node_staging.outputs.get(ck.save) if self.node_staging is not None else None
        if ck.async_save and self.saver is None:
            from slime.backends.megatron.async_save import AsyncSaver

            self.saver = AsyncSaver()
        save_checkpoint(self.models, ck.save, rollout_id, optimizer=self.optimizer if full else None,
                        scheduler=self.scheduler if full else None, extra_state=extra_state or {},
                        metadata={**checkpoint_metadata(self.bridge, ck.hf_checkpoint), "stage": STAGE},
                        config_hash=self.config.section_hash("train", "algorithm", "checkpoint", "megatron"),
                        fully_reshardable=ck.dist_ckpt_optim_fully_reshardable, remote=remote,
                        storage_options=self.config.run.storage_options, keep=ck.keep_checkpoints,
                        saver=self.saver)
        if self.saver is not None and wait:
            self.saver.wait()
        path = iteration_dir(ck.save, rollout_id)
        return self.node_staging.to_remote(path) if remote else path

    def offload(self) -> dict[str, Any]:
        """Free the GPU for the engines: the DDP buffers' bf16 weights go to megatron-core's pinned copies
        (gradients are dropped: the next step zeroes them), the optimizer's fp32 main weights and moments to
        pinned host twins kept from step to step (`slime.offload`; megatron-core's own optimizer offload
        copies into fresh pageable memory, 3 s for a 0.5B model's Adam state on an H100), and to the same
        twins what lives outside those: the frozen parameters (a LoRA base, freeze lists), the trainable ones
        where the DDP buffers hold no copy of them (without the distributed optimizer, megatron's buffers keep
        only the gradients) and the KL reference model. A no-op on CPU."""
        import torch

        if not torch.cuda.is_available() or self.offloaded:
            return {"offloaded": self.offloaded, "device": "cpu" if not torch.cuda.is_available() else "cuda"}
        t0 = time.monotonic()
        for model in self.models:
            for buffer in [*model.buffers, *model.expert_parallel_buffers]:
                buffer.offload_to_cpu(move_params=True, move_grads=True)
        if self.parking is None:
            from slime.offload import HostParking

            self.parking = HostParking()
        moved = self.parking.park(self._optimizer_slots())
        outside = self.parking.park(self.frozen_slots())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.offloaded = True
        return {"offloaded": True, "device": "cuda", "gpu_bytes": torch.cuda.memory_allocated(),
                "optimizer_bytes": moved, "frozen_bytes": outside, "seconds": time.monotonic() - t0}

    def onload(self) -> dict[str, Any]:
        """Bring the weights and optimizer state back to the GPU after `offload`; a no-op on CPU."""
        import torch

        if not self.offloaded:
            return {"offloaded": False}
        t0 = time.monotonic()
        for model in self.models:
            for buffer in [*model.buffers, *model.expert_parallel_buffers]:
                buffer.reload_from_cpu(move_params=True, move_grads=True)
        self.parking.unpark()
        torch.cuda.synchronize()
        self.offloaded = False
        return {"offloaded": False, "device": "cuda", "gpu_bytes": torch.cuda.memory_allocated(),
                "seconds": time.monotonic() - t0}

    def frozen_slots(self) -> Any:
        """What `offload` moves besides the DDP buffers and the optimizer: each policy chunk's frozen
        parameters, its trainable ones where the DDP buffers do not hold them (without the distributed
        optimizer: `offload.unbuffered_parameter_slots`), and every tensor of the reference and OPD teacher
        models (no DDP, never trained)."""
        from slime.offload import frozen_parameter_slots, module_slots, unbuffered_parameter_slots

        for k, model in enumerate(self.models):
            yield from frozen_parameter_slots(model, prefix=f"frozen{k}.")
            yield from unbuffered_parameter_slots(model, prefix=f"policy{k}.")
        for k, model in enumerate(self.ref_models or []):
            yield from module_slots(model, prefix=f"ref{k}.")
        for k, model in enumerate(self.teacher_models or []):
            yield from module_slots(model, prefix=f"teacher{k}.")

    def _optimizer_slots(self) -> Any:
        from slime.backends.megatron.optimizer import torch_optimizers
        from slime.offload import optimizer_slots

        for k, inner in enumerate(torch_optimizers(self.optimizer)):
            yield from optimizer_slots(inner, prefix=k)

    def update_weights(self, urls: list[str], weight_version: int | str) -> dict[str, Any]:
        """Push the current weights to the engines at `urls` (`slime.sync.WeightSyncer`, mode from
        `sync.weight_sync_mode`); the sync metrics. Every rank drains the weight export (it may gather
        tensor-parallel shards); rank 0 alone talks to the engines, so the others return {}."""
        from slime.backends.megatron.bridge import export_hf_weights

        adapter = self.config.sync.lora_sync == "adapter"
        base = self._adapter_base() if adapter else None

        def weights() -> Any:
            if adapter:  # PEFT's adapter tensors (a tensor-parallel collective), slime/sync/adapter.py
                from slime.backends.megatron.lora_export import peft_state_dict

                return iter(peft_state_dict(self.bridge, self.models).items())
            return export_hf_weights(self.bridge, self.models)

        if self.rank != 0:  # the collectives in rank 0's order: the adapters, then (first sync) the base
            for _ in weights():
                pass
            if base is not None and not self._synced_once:
                for _ in base():
                    pass
            self._synced_once = True
            self.keep_old_weights_after_sync()
            return {}
        if self.syncer is None:
            import ray

            from slime.sync import WeightSyncer
            from slime.sync.disk import post_write_hook

            self.syncer = WeightSyncer(self.config.sync, colocated=self.config.cluster.same_gpus,
                                       hf_config=self.bridge.hf_config,
                                       master_address=ray.util.get_node_ip_address(),
                                       post_write=post_write_hook(self.config.as_namespace()),
                                       write_adapter=self._write_adapter if adapter else None, adapter_base=base)
        result = self._loop.run_until_complete(self.syncer.sync(urls, weights, weight_version))
        self.keep_old_weights_after_sync()
        return {**result.metrics(), "sync/weight_version": result.weight_version}

    def _write_adapter(self, state: dict[str, Any], out_dir: str) -> None:
        """Adapter sync's PEFT writer (peft's own, `lora_export.write_peft_adapter`), on the engines' base."""
        from slime.backends.megatron import lora
        from slime.backends.megatron.lora_export import write_peft_adapter

        write_peft_adapter(state, lora.spec_of(self.models[0]), out_dir,
                           base_model=self.config.checkpoint.hf_checkpoint, hf_config=self.bridge.hf_config)

    def _adapter_base(self) -> Any:
        """Adapter sync: the base weights to send once when the adapters' base is not the HF checkpoint the
        engines start from (a LoRA stage on a conversion or a full checkpoint), else None."""

        from slime.backends.megatron import lora
        from slime.backends.megatron.bridge import export_hf_weights

        pointer = lora.base_of(self.models[0])
        hf = self.config.checkpoint.hf_checkpoint
        if pointer is None or (hf and os.path.realpath(pointer["source"]) == os.path.realpath(hf)):
            return None

        def base() -> Any:
            with lora.adapters_disabled(self.models):  # merged_weight gives the base weight itself
                yield from export_hf_weights(self.bridge, self.models)

        return base

    def keep_old_weights_after_sync(self) -> None:
        """--keep-old-actor after the engines got the current weights, as slime: with update_weights_interval 1
        a queue (old := the weights synced before, rollout := now: one-step-off generation trains on rollouts
        of the previous weights), else old := now."""
        if self.old_weights is None:
            return
        if self.config.sync.update_weights_interval == 1:
            self.old_weights, self.rollout_weights = self.rollout_weights, snapshot(self.models)
        else:
            self.old_weights = snapshot(self.models)

    def close(self) -> None:
        """Commit a background save still in flight, release what the weight syncer holds between syncs (its
        process group); idempotent."""
        if self.saver is not None:
            saver, self.saver = self.saver, None
            saver.close()
        if self.syncer is not None:
            self._loop.run_until_complete(self.syncer.close())
            self.syncer = None
        if self.profiler is not None:
            self.profiler.close()


def _peak_memory_bytes() -> float:
    """This rank's peak memory: allocated GPU memory under CUDA, else the process's peak resident set."""

    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB


def _slice_arrays(arrays: Any, start: int, stop: int) -> Any:
    return replace(arrays, **{f.name: getattr(arrays, f.name)[start:stop] for f in fields(arrays)
                              if getattr(arrays, f.name) is not None})


def _all_reduce(values: Any) -> None:
    """Sum a CPU tensor over the data-parallel group in place (through the GPU under NCCL)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() > 1:
        on = values.cuda() if torch.cuda.is_available() else values
        dist.all_reduce(on, group=parallel_state.get_data_parallel_group())
        values.copy_(on.cpu())
