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

The class here is the actor's face (`init`, `train`, `close`); its other concerns live beside it as the parts
it is made of: `train_checkpoints.CheckpointIO` (the weights a run starts from, `save`), `train_inputs.TrainInputs`
(rewards, log-prob passes and advantages of a train call), `train_memory.GpuMemory` (`offload`/`onload`),
`train_sync.WeightSync` (`update_weights`, --keep-old-actor), `train_critic.Critic` (PPO's value critic on these ranks,
--num-critic-only-steps); the pure helpers in `train_data` and `train_weights`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import time
from typing import Any

from slime.backends.megatron.hooks import load_megatron_hooks
from slime.config import Config
from slime.errors import ConfigError, DataFormatError
from slime.heap import pin_mmap_threshold, trim_heap
from slime.net import find_free_port
from slime.ray.ci_checks import check_ci, check_grad_norms, save_grad_norms
from slime.ray.train_checkpoints import CheckpointIO
from slime.ray.train_critic import Critic
from slime.ray.train_data import (
    STAGE,
    can_reuse_log_probs,
    mean_metrics,
    rank_share,
    reused_log_prob_stats,
    slice_arrays,
    steps_per_rollout,
    subsample_rollout,
    total_train_steps,
)
from slime.ray.train_inputs import TrainInputs
from slime.ray.train_memory import GpuMemory
from slime.ray.train_sync import WeightSync
from slime.ray.train_weights import copy_weights, snapshot

logger = logging.getLogger(__name__)



























class TrainActor(CheckpointIO, TrainInputs, GpuMemory, WeightSync, Critic):
    """A Megatron rank: `init`, `train`, `save`, `offload`/`onload`, `update_weights`.

    Construct with the config as a JSON dict (`Config.model_dump(mode="json")`), this rank and the
    world size; rank 0's `init_method()` gives the address every rank passes to `init`.
    """

    def __init__(self, config: dict[str, Any], rank: int, world_size: int,
                 remote_fields: dict[str, str] | None = None) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        pin_mmap_threshold()  # before the first large allocation: the heap stays flat over thousands of calls
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
        self.resumed_from: str | None = None  # the checkpoint `init` resumed training from, if any
        self.resume_partial: dict[str, bool] = {}  # its --no-load-optim / --no-load-rng (load_checkpoint's flags)
        # --- PPO (advantage_estimator ppo): the critic on these ranks, with its own optimizer (train_critic.py)
        self.critic_models: list[Any] | None = None
        self.critic_optimizer: Any = None
        self.critic_scheduler: Any = None
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
            expert_parallel_sizes,
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
        if c.algorithm.loss_type != "policy_loss":
            raise ConfigError(f"algorithm.loss_type {c.algorithm.loss_type!r}: the RL train actor trains "
                              "policy_loss only")
        self.hooks = load_megatron_hooks(c.as_namespace())  # signature-checked before any process group
        tp, pp = model_parallel_sizes(c.megatron, self.world_size)
        ep, etp = expert_parallel_sizes(c.megatron, self.world_size, tp, pp)
        init_megatron(seed=c.run.seed, tensor_parallel=tp, pipeline_parallel=pp, rank=self.rank,
                      world_size=self.world_size, init_method=init_method,
                      timeout_minutes=c.cluster.distributed_timeout_minutes, megatron=c.megatron,
                      expert_parallel=ep, expert_tensor_parallel=etp)
        import torch

        if c.cluster.share_gpu and torch.cuda.is_available():  # the engine holds the rest of this GPU
            torch.cuda.set_per_process_memory_fraction(c.cluster.gpu_fractions()[0])
        if self.hooks.init is not None:
            self.hooks.init(c.as_namespace())
        from slime.backends.megatron.profile import TrainProfiler

        self.profiler = TrainProfiler(c, self.rank)  # memory history from here, as slime's
        hf_dir = c.checkpoint.hf_checkpoint
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.bridge = make_bridge(hf_dir, megatron_dtype(c), vocab_padding(c, hf_dir), c.megatron,
                                  routing_replay=c.algorithm.use_routing_replay or c.algorithm.use_rollout_routing_replay)
        self.lora_spec = LoraSpec.from_config(c)
        self.models = build_model(self.bridge, wrap_with_ddp=True,
                                  use_distributed_optimizer=c.train.use_distributed_optimizer,
                                  post_create=lora_callback(self.lora_spec) or freeze_callback(
                                      c.train.only_train_params_name_list, c.train.freeze_params_name_list))
        self.optimizer, self.scheduler = build_optimizer_and_scheduler(self.models, c, total_train_steps(c))
        if self.lora_spec is not None:
            return self._load_lora_weights()
        if c.algorithm.advantage_estimator == "ppo":  # slime's use_critic
            self._build_critic()
        start = self._load_weights()
        if self.critic_models is not None:
            self._load_critic(self.resumed_from, self.resume_partial)
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
        settings = StepSettings.from_config(c)
        if c.train.balance_by_flops:  # slime: micro-batches of even estimated FLOPs
            settings.workload = self._flops
        values, critic_metrics = None, {}
        if self.critic_models is not None:  # PPO: the critic's values, then its value-loss steps (train_critic.py)
            values, critic_metrics = self.critic_step(rollout_id, shares, settings)
        # slime's --num-critic-only-steps: the first rollouts train the critic alone; the weight sync still runs
        actor_trains = self.critic_models is None or rollout_id >= c.algorithm.num_critic_only_steps
        arrays, stats = self._arrays(rollout_id, mine, reuse, values) if actor_trains else (None, {})
        t2 = time.monotonic()
        settings.reuse_log_probs = reuse
        rows, start = [], 0
        vocab = self.bridge.hf_config.vocab_size
        pad = self.tokenizer.pad_token_id or 0
        for step_id, share in self.profiler.iterate("train_actor", enumerate(shares if actor_trains else [])):
            part = slice_arrays(arrays, start, start + len(share))
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
        if c.train.reset_optimizer_states and actor_trains:
            from slime.backends.megatron.optimizer import reset_optimizer_states

            reset_optimizer_states(self.optimizer)
        t3 = time.monotonic()
        self.profiler.step(rollout_id)
        if reuse and actor_trains:  # one step: its forward's log-probs are the old policy's
            stats.update(reused_log_prob_stats(rows[0], with_kl=arrays.ref_log_probs is not None,
                                               with_entropy=c.algorithm.use_rollout_entropy))
        metrics = {f"train/{k}": v for k, v in mean_metrics(rows).items()}
        interval = c.algorithm.ref_update_interval
        if interval and self.ref_models and (rollout_id + 1) % interval == 0:  # slime: the reference := the actor
            copy_weights(self.models, self.ref_models)
            metrics["train/ref_updated"] = 1.0
            logger.info("rank %d rollout %d: reference model updated from the actor", self.rank, rollout_id)
        metrics.update(stats)
        metrics.update(critic_metrics)
        if actor_trains:
            self._ci_checks(rollout_id, rows, metrics)
        if self.critic_models is not None:
            metrics["train/actor_skipped"] = float(not actor_trains)
        if self.lora_spec is not None:
            from slime.backends.megatron.lora import count_parameters

            metrics.update({"lora/rank": float(self.lora_spec.rank), "lora/peak_memory_bytes": _peak_memory_bytes(),
                            **{f"lora/{k}_params": float(v) for k, v in count_parameters(self.models).items()}})
        trimmed = trim_heap()  # the call's freed host memory back to the OS: RSS stays flat over long runs
        if trimmed is not None:
            metrics["perf/heap_trim_time"] = trimmed
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








    # ------------------------------------------------------------------------- checkpoints, memory, sync










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




