"""One optimizer step of a Megatron model on this data-parallel rank's samples: SFT, policy or value loss.

The samples are split into micro-batches (`micro_batch_size`, or packed by tokens with
`use_dynamic_batch_size`/`max_tokens_per_gpu`, see `batching`), run through megatron-core's
forward/backward schedule (gradients accumulate in the DDP buffers and are all-reduced over the
data-parallel group at the end), then the Megatron optimizer steps with gradient clipping.

Losses are the per-token functions of `slime.algorithms`, reduced over the whole *global* step:

    policy_loss   L = R(pg * w_tis) - entropy_coef * R(H) + kl_loss_coef * R(KL(logp, ref))
    sft_loss      L = R(-logp)
    value_loss    L = R(clipped value error)

with R the per-sample mean over the N samples of the global step (slime's default) or the per-token
mean over its D trained tokens (`calculate_per_token_loss`; D = sum_i max(n_i, 1) as in
`reduce.token_mean`). N and D are all-reduced over the data-parallel group, so each rank's micro-batch
losses are its share of the global loss. Two scale factors undo what Megatron does to them: the
schedule divides each micro-batch loss by the number of micro-batches, and DDP averages the gradients
over data-parallel ranks; hence x num_microbatches x dp_size. Metrics are the same reductions, summed
over micro-batches and ranks: every rank returns the global values. With pipeline parallelism the
schedule is megatron's 1F1B: each stage's forward step calls its part of the model, the last stage's loss
function scores the logits, and the metrics are broadcast from the last stage (`forward.py`).

Policy variants follow `advantage_estimator`: gspo uses the sequence-level ratio, cispo the CISPO
loss, every other estimator the (dual-)clipped PPO surrogate. Old log-probs are the rollout engine's
with `use_rollout_logprobs`, else `TrainArrays.old_log_probs` when the caller recomputed them, else this
forward's own log-probs, detached: slime's shortcut for the first step on a rollout's policy, where the
ratio is exactly 1 (a caller taking several steps per rollout must pass the log-probs computed before
the first, or the ratio never leaves 1). TIS weights compare the trainer's old log-probs (the same fallback) with the
rollout's. With `reuse_log_probs` (the caller skipped its old-log-prob pass, slime's can_reuse_log_probs_in_loss)
the step also reports, under `REUSED_PREFIX`, the sums that pass would have given the rollout metrics (log-probs,
|old - rollout|, KL to the reference, entropy, and their token counts), taken from this forward, detached.
With `TrainArrays.routed_experts` (MoE routing replay, R2/R3) every micro-batch's routers use those experts
(routing_replay.py).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.policy_loss import (
    cispo_loss,
    gspo_policy_loss,
    opsm_keep,
    policy_loss,
    sft_loss,
    tis_weights,
    value_loss,
)
from slime.algorithms.reduce import sample_mean, token_mean
from slime.backends.megatron import cuda_graphs, routing_replay
from slime.backends.megatron.batching import check_expert_parallel_counts, micro_batches
from slime.backends.megatron.critic import values_from_output
from slime.backends.megatron.forward import broadcast_from_last_stage, prepare_schedule
from slime.backends.megatron.logprobs import forward_logits, score_logits
from slime.backends.megatron.step_data import MicroBatch, TrainArrays, build_micro_batch
from slime.errors import ConfigError, DataFormatError
from slime.plugins import PluginError, load_function, load_plugin_field
from slime.types import Sample

# slime calls its TIS function with these keywords only (`tis_func(**tis_kwargs)`)
TIS_KEYWORDS = ("args", "pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths",
                "response_lengths")


def load_tis_function(path: str) -> Callable[..., Any]:
    """slime's --custom-tis-function-path, checked to take slime's keywords."""
    fn = load_function(path)
    try:
        inspect.signature(fn).bind(**dict.fromkeys(TIS_KEYWORDS))
    except TypeError as e:
        raise PluginError(f"custom_tis_function_path (--custom-tis-function-path): plugin {path!r} cannot be called "
                          f"as fn({', '.join(k + '=...' for k in TIS_KEYWORDS)}): {e}") from None
    except ValueError:  # no inspectable signature
        pass
    return fn

LOSS_TYPES = ("sft_loss", "policy_loss", "value_loss")
# metrics of a `reuse_log_probs` step: sums over the step's trained tokens (all ranks) of this forward's log-probs
REUSED_PREFIX = "reused_log_probs/"


@dataclass
class StepSettings:
    """What one train step needs to know besides the data (slime's flag names)."""

    loss_type: str = "sft_loss"  # sft_loss | policy_loss | value_loss
    micro_batch_size: int = 1
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    temperature: float = 1.0
    advantage_estimator: str = "grpo"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    value_clip: float = 0.2
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    entropy_coef: float = 0.0
    use_rollout_logprobs: bool = False
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    calculate_per_token_loss: bool = False
    use_unbiased_kl: bool = False
    use_opsm: bool = False
    opsm_delta: float = 1e-4
    get_mismatch_metrics: bool = False
    # the caller did not recompute old log-probs (one step per rollout): report REUSED_PREFIX sums for its metrics
    reuse_log_probs: bool = False
    data_pad_size_multiplier: int = 1  # micro-batch token width rounded up to a multiple of it
    log_probs_chunk_size: int = -1  # response positions scored per chunk (-1: all at once)
    compile_scores: bool | None = None  # the scoring chunks torch.compile'd (None: on under CUDA with Triton)
    fp32_logits: bool = False  # Float16Module upcasts the logits to fp32 (False: scored from the model's dtype)
    recompute_loss_function: bool = False  # score and loss from the logits recomputed in the backward pass
    workload: Callable[[int], float] | None = None  # --balance-by-flops: a length's cost (batching.micro_batches)
    # slime's --custom-tis-function-path, bound to `args`: fn(*, pg_loss, train_log_probs, rollout_log_probs,
    # loss_masks, total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics), on slime's flat layout
    custom_tis: Callable[..., Any] | None = None
    # slime's --custom-pg-loss-reducer-function-path: fn(total_lengths, response_lengths, loss_masks,
    # calculate_per_token_loss) -> reducer(flat per-token values) -> sum of sample means (or of tokens)
    pg_loss_reducer: Callable[..., Any] | None = None

    @classmethod
    def from_config(cls, config: Any, loss_type: str | None = None) -> StepSettings:
        """Settings from the typed config (algorithm, train and rollout temperature); `loss_type`
        overrides `algorithm.loss_type` (the critic trains with value_loss)."""
        a, t = config.algorithm, config.train
        custom_tis = None
        if a.custom_tis_function_path:
            args = config.as_namespace()
            custom_tis = partial(load_tis_function(a.custom_tis_function_path), args=args)
        reducer = None
        if a.custom_pg_loss_reducer_function_path:
            reducer = load_plugin_field(config.as_namespace(), "custom_pg_loss_reducer_function_path",
                                        ["total_lengths", "response_lengths", "loss_masks",
                                         "calculate_per_token_loss"], is_async=False)
        return cls(custom_tis=custom_tis, pg_loss_reducer=reducer, loss_type=loss_type or a.loss_type, micro_batch_size=t.micro_batch_size,
                   use_dynamic_batch_size=t.use_dynamic_batch_size, max_tokens_per_gpu=t.max_tokens_per_gpu,
                   temperature=config.rollout.rollout_temperature, advantage_estimator=a.advantage_estimator,
                   eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high, eps_clip_c=a.eps_clip_c,
                   value_clip=a.value_clip, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
                   kl_loss_type=a.kl_loss_type, entropy_coef=a.entropy_coef,
                   use_rollout_logprobs=a.use_rollout_logprobs, use_tis=a.use_tis, tis_clip=a.tis_clip,
                   tis_clip_low=a.tis_clip_low, calculate_per_token_loss=a.calculate_per_token_loss,
                   use_unbiased_kl=a.use_unbiased_kl, use_opsm=a.use_opsm, opsm_delta=a.opsm_delta,
                   get_mismatch_metrics=a.get_mismatch_metrics,
                   data_pad_size_multiplier=t.data_pad_size_multiplier, log_probs_chunk_size=t.log_probs_chunk_size,
                   compile_scores=t.compile_scores, fp32_logits=t.fp32_logits,
                   recompute_loss_function=t.recompute_loss_function)


def _check_inputs(samples: list[Sample], settings: StepSettings, arrays: TrainArrays) -> None:
    """Refuse a step whose settings need data the caller did not provide, before any forward."""
    if settings.loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type {settings.loss_type!r} is not supported by the Megatron train step; "
                          f"valid: {', '.join(LOSS_TYPES)}")
    if not samples:
        raise ConfigError("train_step needs at least one sample on every data-parallel rank")
    arrays.check(samples)
    if settings.reuse_log_probs and (settings.loss_type != "policy_loss" or arrays.old_log_probs is not None):
        raise ConfigError("reuse_log_probs means the loss's own log-probs are the old ones: it needs loss_type "
                          "policy_loss and no TrainArrays.old_log_probs")
    if settings.loss_type == "policy_loss" and (settings.use_rollout_logprobs or settings.use_tis
                                                or settings.get_mismatch_metrics):
        for sample in samples:
            if sample.rollout_log_probs is None:
                flag = "use_rollout_logprobs" if settings.use_rollout_logprobs else \
                    "use_tis" if settings.use_tis else "get_mismatch_metrics"
                raise DataFormatError(f"sample index={sample.index}: {flag} needs rollout_log_probs, which it lacks")
    if settings.loss_type == "policy_loss" and settings.use_kl_loss and arrays.ref_log_probs is None:
        raise ConfigError("use_kl_loss needs reference log-probs: pass TrainArrays.ref_log_probs "
                          "(compute_log_probs with the reference model)")
    if settings.loss_type == "value_loss" and arrays.returns is None:
        raise ConfigError("value_loss needs TrainArrays.returns (advantages.compute_advantages(...).returns)")


@dataclass
class _Step:
    """Constants of one step that every micro-batch loss needs."""

    settings: StepSettings
    vocab_size: int
    num_samples: int  # global N
    num_tokens: int  # global D
    scale: float  # num_microbatches x dp_size
    routers: routing_replay.Routers | None = None  # the routers replaying TrainArrays.routed_experts

    def reduce(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the global per-sample or per-token mean."""
        if self.settings.calculate_per_token_loss:
            return token_mean(per_token, mask, num_tokens=self.num_tokens)
        return sample_mean(per_token, mask, num_samples=self.num_samples)


def _policy_terms(step: _Step, micro: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total policy loss of one micro-batch and its reduced parts (metrics)."""
    s, reduce = step.settings, step.reduce
    train_old = micro.old_log_probs if micro.old_log_probs is not None else logp.detach()
    old = micro.rollout_log_probs if s.use_rollout_logprobs else train_old
    clip = dict(eps_clip=s.eps_clip, eps_clip_high=s.eps_clip_high)
    if s.advantage_estimator == "cispo":
        out = cispo_loss(logp, old, micro.advantages, mask, **clip)
    elif s.advantage_estimator == "gspo":
        out = gspo_policy_loss(logp, old, micro.advantages, mask, eps_clip_c=s.eps_clip_c, **clip)
    else:
        out = policy_loss(logp, old, micro.advantages, mask, eps_clip_c=s.eps_clip_c, **clip)
    pg = out.loss
    parts: dict[str, torch.Tensor] = {"pg_clipfrac": reduce(out.clipfrac, mask), "ppo_kl": reduce(out.ppo_kl, mask)}
    if s.use_opsm:  # slime: after the surrogate, before TIS
        keep = opsm_keep(logp, old, micro.advantages, mask, s.opsm_delta)
        pg = pg * keep
        parts["opsm_clipfrac"] = reduce(1.0 - keep, mask)
    if s.use_tis and s.custom_tis is not None:
        pg, mask_after, tis_metrics = _custom_tis(s.custom_tis, micro, pg, train_old, mask)
        pg = pg * mask_after  # rejected tokens add nothing; the denominators stay the original masks' (slime)
        parts.update({k: reduce(v, mask) for k, v in tis_metrics.items()})
        parts["train_rollout_logprob_abs_diff"] = reduce((train_old - micro.rollout_log_probs).abs(), mask)
    elif s.use_tis:
        weights = tis_weights(train_old, micro.rollout_log_probs, s.tis_clip_low, s.tis_clip, mask)
        raw = torch.exp(torch.where(mask, train_old.float() - micro.rollout_log_probs, 0.0))
        pg = pg * weights
        parts["tis"] = reduce(weights, mask)
        parts["tis_clipfrac"] = reduce((weights != raw).float(), mask)
        parts["train_rollout_logprob_abs_diff"] = reduce((train_old - micro.rollout_log_probs).abs(), mask)
    if s.get_mismatch_metrics:  # slime's mismatch metrics (its default TIS function's), without reweighting
        raw = torch.exp(torch.where(mask, train_old.float() - micro.rollout_log_probs, 0.0))
        clamped = raw.clamp(s.tis_clip_low, s.tis_clip)
        parts["mismatch/tis"] = reduce(raw, mask)
        parts["mismatch/tis_clipfrac"] = reduce((clamped != raw).float(), mask)
        parts["mismatch/tis_abs"] = reduce((raw - 1).abs(), mask)
        parts["mismatch/ois"] = reduce(torch.exp(torch.where(mask, logp.float() - old.float(), 0.0)), mask)
        parts["train_rollout_logprob_abs_diff"] = reduce((train_old - micro.rollout_log_probs).abs(), mask)
    if s.pg_loss_reducer is not None:  # slime's reducer gives a sum of sample means (or of tokens): normalise
        lengths = list(micro.batch.host_response_lengths)
        reducer = s.pg_loss_reducer([p + n for p, n in zip(micro.batch.host_prompt_lengths, lengths, strict=True)],
                                    lengths, [mask[i, :n].int() for i, n in enumerate(lengths)],
                                    s.calculate_per_token_loss)
        pg_loss = reducer(_flat(pg, lengths)) / (step.num_tokens if s.calculate_per_token_loss else step.num_samples)
    else:
        pg_loss = reduce(pg, mask)
    entropy_loss = reduce(entropy, mask)
    total = pg_loss - s.entropy_coef * entropy_loss if s.entropy_coef else pg_loss
    parts.update(pg_loss=pg_loss, entropy_loss=entropy_loss)
    if s.use_kl_loss:
        kl = compute_approx_kl(logp, micro.ref_log_probs, s.kl_loss_type)
        if s.use_unbiased_kl:  # slime: weighted by the importance ratio pi / pi_old (with its gradient)
            kl = kl * torch.exp(logp.float() - old.float())
        kl_loss = reduce(kl, mask)
        total = total + s.kl_loss_coef * kl_loss
        parts["kl_loss"] = kl_loss
    if s.reuse_log_probs:
        parts.update(_reused_sums(step, micro, logp.detach(), entropy, mask))
    return total, parts


def _reused_sums(step: _Step, micro: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over this micro-batch's trained tokens that the skipped old-log-prob pass would have given the
    rollout metrics; every micro-batch reports every key (the metrics are summed name by name)."""
    logp = logp.float()
    sums = {"tokens": mask.sum(), "log_probs": logp[mask].sum(), "entropy": entropy.detach().float()[mask].sum()}
    if micro.rollout_log_probs is not None:  # only the rows whose samples carry rollout log-probs
        rows = mask & micro.rollout_rows[:, None]
        sums["abs_diff"] = (logp - micro.rollout_log_probs).abs()[rows].sum()
        sums["abs_diff_tokens"] = rows.sum()
    else:
        sums["abs_diff"] = sums["abs_diff_tokens"] = torch.zeros((), device=logp.device)
    if micro.ref_log_probs is not None:
        sums["kl"] = compute_approx_kl(logp, micro.ref_log_probs, step.settings.kl_loss_type)[mask].sum()
    return {REUSED_PREFIX + name: value.to(torch.float64) for name, value in sums.items()}


def _flat(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """`[b, R]` -> slime's layout: each row's first `lengths[i]` values, one row after the other."""
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)])


def _custom_tis(fn: Callable[..., Any], micro: MicroBatch, pg: torch.Tensor, train_old: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Call a slime TIS function on slime's layout (per-token values of the micro-batch's responses, one after
    the other; per-sample lists) and bring its loss, masks and metrics back to `[b, R]`."""
    lengths = list(micro.batch.host_response_lengths)
    rows = range(len(lengths))

    def flat(x: torch.Tensor) -> torch.Tensor:
        return _flat(x, lengths)

    def padded(values: torch.Tensor) -> torch.Tensor:
        out, start = torch.zeros_like(pg), 0
        for i in rows:
            out[i, : lengths[i]] = values[start: start + lengths[i]]
            start += lengths[i]
        return out

    new_pg, masks, metrics = fn(
        pg_loss=flat(pg), train_log_probs=[train_old[i, : lengths[i]] for i in rows],
        rollout_log_probs=[micro.rollout_log_probs[i, : lengths[i]] for i in rows],
        loss_masks=[mask[i, : lengths[i]].int() for i in rows],
        total_lengths=[p + lengths[i] for i, p in enumerate(micro.batch.host_prompt_lengths)],
        response_lengths=lengths)
    new_mask = padded(torch.cat([m.to(pg.dtype) for m in masks])) if masks is not None else mask.to(pg.dtype)
    return padded(new_pg), new_mask, {k: padded(v.to(pg.dtype)) for k, v in metrics.items()}


def _forward_step(step: _Step, data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """Forward one micro-batch; return the model's output and the closure the schedule calls for the loss.

    The output is the logits (the critic's values) on the last pipeline stage, hidden states on the
    others; only the last stage calls `loss_func`, which scores the output. With slime's
    --recompute-loss-function the scoring runs under `torch.utils.checkpoint`, so the `[b, R, V]` softmax
    activations are not kept for the backward pass but recomputed there (same values, less memory)."""
    micro: MicroBatch = next(data_iterator)
    s = step.settings

    def terms(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if s.loss_type == "value_loss":
            values, response_mask = values_from_output(output, micro.batch)
            return _loss_terms(step, micro, values, None, response_mask & micro.loss_mask)
        logp, response_mask, entropy = score_logits(output, micro.batch, vocab_size=step.vocab_size,
                                                    temperature=s.temperature,
                                                    with_entropy=s.loss_type == "policy_loss",
                                                    chunk_size=s.log_probs_chunk_size,
                                                    compile_scores=s.compile_scores)
        if entropy is not None and not s.entropy_coef:
            entropy = entropy.detach()  # a metric only: keep it out of the graph
        return _loss_terms(step, micro, logp, entropy, response_mask & micro.loss_mask)

    recompute = s.recompute_loss_function and s.loss_type != "value_loss"

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total, parts = checkpoint(terms, output, use_reentrant=False) if recompute else terms(output)
        reported = {name: value.detach() for name, value in parts.items()}
        reported["loss"] = total.detach()
        return total * step.scale, reported

    if micro.routed_experts is not None:
        routing_replay.replay_forward(step.routers, micro.routed_experts)
    # a critic's values [B, S, 1] stay fp32 as megatron returns them: only the vocabulary's logits are large
    output = forward_logits(model, micro.batch, fp32=s.fp32_logits or s.loss_type == "value_loss")
    if micro.routed_experts is not None:
        routing_replay.forward_done(step.routers)
    return output, loss_func


def _loss_terms(step: _Step, micro: MicroBatch, output: torch.Tensor, entropy: torch.Tensor | None,
                mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's total loss and its reduced parts, from its log-probs (or values)."""
    s = step.settings
    if s.loss_type == "sft_loss":
        total = step.reduce(sft_loss(output, mask), mask)
        return total, {"sft_loss": total}
    if s.loss_type == "policy_loss":
        return _policy_terms(step, micro, output, entropy, mask)
    old = micro.old_values if micro.old_values is not None else output.detach()
    out = value_loss(output, old, micro.returns, mask, s.value_clip)
    total = step.reduce(out.loss, mask)
    return total, {"value_loss": total, "value_clipfrac": step.reduce(out.clipfrac, mask)}


def _global_counts(samples: list[Sample], device: torch.device) -> tuple[int, int]:
    """(N, D) of the global step: samples, and sum_i max(trained tokens_i, 1), summed over DP ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    counts = torch.tensor([len(samples), sum(max(s.effective_response_length, 1) for s in samples)],
                          dtype=torch.float64, device=device)
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    return int(counts[0]), int(counts[1])


def _sum_over_ranks(reduced: list[dict[str, torch.Tensor]], device: torch.device) -> dict[str, float]:
    """Sum each metric over micro-batches and data-parallel ranks (each part is already a global share)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    names = sorted(reduced[0]) if reduced else []
    totals = torch.tensor([float(sum(r[name] for r in reduced)) for name in names], dtype=torch.float64,
                          device=device)
    if names and parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return dict(zip(names, totals.tolist(), strict=True))


def train_step(models: list[torch.nn.Module], optimizer: Any, samples: list[Sample], settings: StepSettings, *,
               vocab_size: int, pad_token_id: int = 0, arrays: TrainArrays | None = None) -> dict[str, float]:
    """Accumulate gradients over this rank's `samples` (its share of the global batch) and take one
    optimizer step; returns global step metrics (loss parts, clip fractions, grad_norm, lr)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    arrays = arrays or TrainArrays()
    _check_inputs(samples, settings, arrays)
    prepare_schedule(models)
    device = next(models[0].parameters()).device
    parts = micro_batches([len(s.tokens) for s in samples], micro_batch_size=settings.micro_batch_size,
                          use_dynamic_batch_size=settings.use_dynamic_batch_size,
                          max_tokens_per_gpu=settings.max_tokens_per_gpu, workload=settings.workload)
    check_expert_parallel_counts(len(parts), device)
    micro = [build_micro_batch(samples, indices, arrays, pad_token_id=pad_token_id, device=device,
                               pad_multiple=settings.data_pad_size_multiplier) for indices in parts]
    routers = None
    if arrays.routed_experts is not None:  # MoE routing replay (R2/R3): each micro-batch's ids in its layout
        routers = routing_replay.require_routers(models)
        for m in micro:
            m.routed_experts = routing_replay.micro_batch_ids([arrays.routed_experts[i] for i in m.indices],
                                                              m.batch.tokens.shape[1], routers, device)
    graphs = cuda_graphs.enabled(models)
    shapes = [tuple(m.batch.tokens.shape) for m in micro]
    if graphs:
        cuda_graphs.check_shapes(models, shapes)
    num_samples, num_tokens = _global_counts(samples, device)
    step = _Step(settings, vocab_size, num_samples, num_tokens,
                 scale=float(len(micro) * parallel_state.get_data_parallel_world_size()), routers=routers)
    for model in models:
        model.train()
        model.zero_grad_buffer()
    optimizer.zero_grad()
    with routing_replay.cleared_after(routers):
        reduced = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, step), data_iterator=iter(micro), model=models,
            num_microbatches=len(micro), seq_length=max(m.batch.tokens.shape[1] for m in micro),
            micro_batch_size=max(len(m.indices) for m in micro), forward_only=False)
    if graphs and cuda_graphs.graphs_created():  # the first step's schedule captured them at its end
        cuda_graphs.note_captured(models, shapes)
    updated, grad_norm, _ = optimizer.step()
    # the loss parts exist on the last pipeline stage only (the others' `reduced` is empty)
    metrics = broadcast_from_last_stage(_sum_over_ranks(reduced, device))
    metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
                   update_successful=float(bool(updated)), lr=optimizer.param_groups[0]["lr"],
                   num_microbatches=float(len(micro)),
                   max_microbatch_tokens=float(max(m.batch.tokens.numel() for m in micro)))
    return metrics
