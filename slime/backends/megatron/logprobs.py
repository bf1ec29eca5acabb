"""Response log-probs (and entropy) of samples under a Megatron model: what the trainer compares with
the rollout engine's log-probs and feeds to the policy loss.

Samples are right-padded into one `[B, S]` batch; with causal attention, padding after a sequence
never affects its own positions, so no attention mask is needed. Logits at position j predict token
j + 1, so the response tokens `tokens[P : P + R]` of a sample with prompt length P are scored by the
logits at positions `P - 1 ... P + R - 2`. Outputs are response-aligned `[B, R_max]` tensors with a
mask, the layout of `slime.algorithms`.

Megatron pads the vocabulary (to a multiple of 128); the padded entries are not tokens, so they are
cut off before the softmax; otherwise they would take probability mass and the log-probs would
differ from the HF model's and the engine's. Temperature divides the logits as in sampling.
Without tensor parallelism `ResponseScores` scores straight from the (bf16) logits: each row's scoring
positions are one contiguous range, read as a view, chunk by chunk in fp32, and its backward writes the
logits' gradient chunk by chunk, so no fp32 `[B, R, V]` copy (nor a gathered one) is ever made. With
tensor parallelism the logits are vocab-sharded; each rank scores the gathered scoring positions with
all-reduced sums over the tensor-parallel group (`_vocab_parallel_scores`). With `chunk_size` > 0
(slime's --log-probs-chunk-size) the response positions are scored `chunk_size` at a time, so the
softmax over the vocabulary never holds more than `[B, chunk_size, V]` at once (unset, the fused path
picks chunks of `CHUNK_ELEMENTS`); the values do not change.

`compute_log_probs` runs this forward-only over micro-batches (fixed size or packed by tokens) for the
reference model, the old policy and tests, and returns one response-aligned tensor per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from slime.backends.megatron import routing_replay, score_kernels
from slime.backends.megatron.batching import check_expert_parallel_counts, micro_batches
from slime.backends.megatron.forward import forward_only, is_last_stage, pipeline_size, share_from_last_stage
from slime.errors import ConfigError
from slime.types import Sample


@dataclass
class PaddedBatch:
    """Samples as one right-padded token batch, with what is needed to find each response.

    The lengths are kept twice: as tensors on the batch's device (for masks and positions) and as host
    ints (for shapes, slicing and Python-side reducers). Reading a CUDA tensor's values on the host waits
    for all the GPU work queued before it, so a length read per micro-batch would drain the GPU between
    micro-batches and make it wait for the host's next launches; the host copies cost nothing to read."""

    tokens: torch.Tensor  # [B, S] long, right-padded
    prompt_lengths: torch.Tensor  # [B] long
    response_lengths: torch.Tensor  # [B] long
    host_prompt_lengths: tuple[int, ...] = ()  # the same values on the host (filled from the tensors if left out)
    host_response_lengths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.host_prompt_lengths) != len(self.prompt_lengths):
            self.host_prompt_lengths = tuple(int(n) for n in self.prompt_lengths.tolist())
        if len(self.host_response_lengths) != len(self.response_lengths):
            self.host_response_lengths = tuple(int(n) for n in self.response_lengths.tolist())

    @property
    def max_response_length(self) -> int:
        return max(self.host_response_lengths, default=0)


def to_device(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory without blocking, since a plain copy from
    pageable memory synchronises the stream (the host would wait for all queued GPU work at every
    micro-batch). The caching host allocator keeps the pinned block until the copy has run."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pad_samples(samples: list[Sample], pad_token_id: int = 0, device: str | torch.device = "cpu",
                multiple: int = 1) -> PaddedBatch:
    """Right-pad the samples' `tokens` to the longest, rounded up to a multiple of `multiple` (slime's
    --data-pad-size-multiplier: kernels and sequence parallelism want round lengths); every sample needs a
    prompt of at least one token."""
    width = -(-max(len(s.tokens) for s in samples) // multiple) * multiple
    tokens = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    for row, sample in enumerate(samples):
        if len(sample.tokens) - sample.response_length < 1:
            raise ConfigError(f"sample {sample.index}: no prompt token before the response; cannot score it")
        tokens[row, : len(sample.tokens)] = torch.tensor(sample.tokens, dtype=torch.long)
    response = tuple(s.response_length for s in samples)
    prompt = tuple(len(s.tokens) - s.response_length for s in samples)
    return PaddedBatch(to_device(tokens, device), to_device(torch.tensor(prompt, dtype=torch.long), device),
                       to_device(torch.tensor(response, dtype=torch.long), device), prompt, response)


def response_positions(batch: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[B, R_max]` indices of the logits that score each response token, `[B, R_max]` bool mask)."""
    steps = torch.arange(batch.max_response_length, device=batch.tokens.device).unsqueeze(0)
    mask = steps < batch.response_lengths.unsqueeze(1)
    positions = (batch.prompt_lengths.unsqueeze(1) - 1 + steps).clamp(max=batch.tokens.shape[1] - 2)
    return torch.where(mask, positions, 0), mask


def response_log_probs(
    model: torch.nn.Module,
    batch: PaddedBatch,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs `[B, R_max]` of the response tokens (0 where masked), the mask, and optionally the
    entropy `[B, R_max]` of each scoring distribution, computed `chunk_size` response positions at a time
    (all at once when <= 0). Gradients flow when called with grad enabled."""
    return score_logits(forward_logits(model, batch), batch, vocab_size=vocab_size, temperature=temperature,
                        with_entropy=with_entropy, chunk_size=chunk_size)


def forward_logits(model: torch.nn.Module, batch: PaddedBatch, fp32: bool = True) -> torch.Tensor:
    """The model's logits `[B, S, V_padded]` (vocab-sharded under tensor parallelism) for the batch.

    A bf16/fp16 model (megatron's `Float16Module`) returns them upcast to fp32 unless `fp32` is False: then in the
    model's dtype, which `score_logits` reads as well (it computes in fp32 chunk by chunk, the same values:
    the upcast is exact, and the logits' gradient is rounded to the model's dtype once either way). At 4096
    positions of a 152k vocabulary the upcast writes a 2.5 GB fp32 copy, and its backward reads a 2.5 GB fp32
    gradient (train.fp32_logits)."""
    seq = batch.tokens.shape[1]
    position_ids = torch.arange(seq, device=batch.tokens.device).unsqueeze(0).expand_as(batch.tokens)
    extra = {} if fp32 or not _float16_wrapped(model) else {"fp32_output": False}
    return model(input_ids=batch.tokens, position_ids=position_ids, attention_mask=None, **extra)


def _float16_wrapped(model: torch.nn.Module) -> bool:
    """Whether megatron's `Float16Module` (which takes `fp32_output`) is in the chain of wrappers (DDP, ...)."""
    from megatron.core.transformer.module import Float16Module

    while model is not None:
        if isinstance(model, Float16Module):
            return True
        model = getattr(model, "module", None)
    return False


def score_logits(logits: torch.Tensor, batch: PaddedBatch, *, vocab_size: int, temperature: float = 1.0,
                 with_entropy: bool = False, chunk_size: int = -1,
                 compile_scores: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` from the logits of `forward_logits`: the part the train step may recompute in
    the backward pass instead of keeping its activations (slime's --recompute-loss-function).

    Without tensor parallelism the scores come from `ResponseScores`, which reads each row's scoring
    positions as a view of the logits and never materialises an fp32 `[B, R, V]` copy; under tensor
    parallelism the scoring positions are gathered and scored by `_vocab_parallel_scores`. `compile_scores`
    (`train.compile_scores`): `ResponseScores`' chunks run torch.compile'd (`score_kernels`); unset, on CUDA."""
    from megatron.core import parallel_state

    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0 to score tokens, got {temperature}")
    seq = batch.tokens.shape[1]
    positions, mask = response_positions(batch)
    targets = batch.tokens.gather(1, (positions + 1).clamp(max=seq - 1))
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logp, entropy = _parallel_scores(logits, positions, targets, vocab_size, temperature, with_entropy,
                                         chunk_size)
    else:
        starts = tuple(n - 1 for n in batch.host_prompt_lengths)
        logp, entropy = ResponseScores.apply(logits, targets, starts, batch.host_response_lengths, vocab_size,
                                             temperature, chunk_size, with_entropy,
                                             score_kernels.use_compiled(compile_scores, logits.device))
    logp = torch.where(mask, logp, 0.0)
    entropy = torch.where(mask, entropy, 0.0) if with_entropy else None
    return logp, mask, entropy


def _parallel_scores(logits: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                     temperature: float, with_entropy: bool,
                     chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) `[B, R_max]` from vocab-sharded logits, `chunk_size` positions at a time."""
    # only the scoring positions: [B, R_max, V_local], temperature-scaled
    scoring = logits.gather(1, positions.unsqueeze(2).expand(-1, -1, logits.shape[2])).float() / temperature
    width = scoring.shape[1]
    step = chunk_size if chunk_size > 0 else max(width, 1)
    pieces = [_vocab_parallel_scores(scoring[:, i:i + step], targets[:, i:i + step], vocab_size, with_entropy)
              for i in range(0, width, step)] or [_vocab_parallel_scores(scoring, targets, vocab_size, with_entropy)]
    logp = torch.cat([p[0] for p in pieces], dim=1)
    return logp, torch.cat([p[1] for p in pieces], dim=1) if with_entropy else None


# fp32 elements of one scoring chunk when `chunk_size` is unset: 2^26 x 4 bytes = 256 MiB (~440 positions of
# a 152k vocabulary), enough to keep each kernel large, small next to the `[B, S, V]` bf16 logits
CHUNK_ELEMENTS = 2**26


class ResponseScores(torch.autograd.Function):
    """Response log-probs (and entropies) `[B, R_max]` straight from the logits `[B, S, V_padded]`.

    Row b's response is scored by positions `starts[b] ... starts[b] + lengths[b] - 1`, one contiguous
    range, so each chunk is a view of the logits (all rows at once when they share their range, as in
    SFT) instead of a gathered copy. Per chunk of positions, forward computes in fp32 from the logits'
    dtype z = logits[..., :V] / T, log Z = logsumexp(z), log p(target) = z_target - log Z and, with
    `with_entropy`, H = log Z - E_p[z]; it keeps only log Z and E_p[z] (`[B, R]`) and the logits it was
    given. Backward recomputes p = exp(z - log Z) chunk by chunk and writes, into a gradient of the
    logits' dtype and shape (0 on prompt, padding and padded-vocabulary entries),

        dL/dlogits = (g_logp * (onehot(target) - p) + g_H * p * (E_p[z] - z)) / T.

    At most one `[rows, chunk, V]` fp32 chunk (and its p) is alive at a time, none with `compiled` (the chunk's
    work torch.compile'd into fused kernels, `score_kernels`; same values to fp32 rounding). Positions past a row's
    length give log-prob and entropy 0 (the caller masks them). `chunk_size` <= 0 picks chunks of about
    `CHUNK_ELEMENTS`; the values do not depend on it. Compiled, with `chunk_size` unset and no padded vocabulary,
    the backward is one kernel over the whole logits that writes their gradient itself (`_whole_rows`), instead of
    chunks each written and then copied into a zero-bordered gradient (one bf16 pass over `[B, S, V]` fewer); the
    same pointwise arithmetic. An explicit `chunk_size` keeps the chunks (bench/train_step.py's A/B).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, starts: tuple[int, ...],
                lengths: tuple[int, ...], vocab_size: int, temperature: float, chunk_size: int,
                with_entropy: bool, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = targets.shape
        logp = torch.zeros(rows, width, dtype=torch.float32, device=logits.device)
        log_z, mean_z = torch.zeros_like(logp), torch.zeros_like(logp)
        chunk_forward, _ = score_kernels.kernels(compiled)
        for rs, start, i, n in _chunks(starts, lengths, vocab_size, chunk_size):
            lp, lz, mz = chunk_forward(logits[rs, start + i:start + i + n, :vocab_size],
                                       _piece(targets, rs, i, n), temperature, with_entropy)
            logp[rs, i:i + n], log_z[rs, i:i + n] = lp, lz
            if with_entropy:
                mean_z[rs, i:i + n] = mz
        ctx.save_for_backward(logits, targets, log_z, mean_z)
        ctx.setup = (starts, lengths, vocab_size, temperature, chunk_size, compiled)
        ctx.set_materialize_grads(False)
        entropy = log_z - mean_z if with_entropy else torch.zeros_like(logp)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple:
        logits, targets, log_z, mean_z = ctx.saved_tensors
        starts, lengths, vocab_size, temperature, chunk_size, compiled = ctx.setup
        if grad_logp is None and grad_entropy is None:
            return torch.zeros_like(logits), None, None, None, None, None, None, None, None
        _, chunk_backward = score_kernels.kernels(compiled)
        if compiled:  # zeros for a missing gradient (same values): one compiled variant instead of three
            grad_logp = torch.zeros_like(log_z) if grad_logp is None else grad_logp
            grad_entropy = torch.zeros_like(log_z) if grad_entropy is None else grad_entropy
            if chunk_size <= 0 and vocab_size == logits.shape[2]:
                grad = chunk_backward(logits, *_whole_rows(logits, starts, lengths, targets, log_z, mean_z, grad_logp,
                                                           grad_entropy), temperature)
                return grad, None, None, None, None, None, None, None, None
        grad = _unscored_zeroed(logits, starts, lengths, vocab_size)
        for rs, start, i, n in _chunks(starts, lengths, vocab_size, chunk_size):
            grad[rs, start + i:start + i + n, :vocab_size] = chunk_backward(
                logits[rs, start + i:start + i + n, :vocab_size], _piece(targets, rs, i, n), _piece(log_z, rs, i, n),
                _piece(mean_z, rs, i, n), _piece(grad_logp, rs, i, n), _piece(grad_entropy, rs, i, n), temperature)
        return grad, None, None, None, None, None, None, None, None


def _whole_rows(logits: torch.Tensor, starts: tuple[int, ...], lengths: tuple[int, ...],
                *response: torch.Tensor) -> list[torch.Tensor]:
    """The backward's response-aligned `[B, R]` inputs (targets, log Z, E_p[z], the two gradients) laid out along
    the logits' positions `[B, S]`, for one compiled backward over the whole logits: positions that score nothing
    get log Z = +inf (so p = exp(z - log Z) = 0) and zero gradients, which makes their gradient exactly 0. The
    kernel then writes the logits' gradient itself: no chunk written and copied into it, no zero-filling."""
    rows, seq = logits.shape[:2]
    out = []
    for k, values in enumerate(response):
        fill = float("inf") if k == 1 else 0  # k 1: log Z
        full = torch.full((rows, seq), fill, dtype=values.dtype, device=values.device)
        for rs, start, length, _ in _row_spans(starts, lengths):
            n = min(max(length, 0), seq - max(start, 0))
            if n > 0:
                full[rs, start:start + n] = values[rs, :n]
        out.append(full)
    return out


def _piece(values: torch.Tensor | None, rows: slice, i: int, n: int) -> torch.Tensor | None:
    """A chunk's `[rows, n]` part of a response-aligned tensor, contiguous: a view's row stride is the full
    width, which compiled kernels would guard on (a recompile whenever a chunk spans the whole width)."""
    return None if values is None else values[rows, i:i + n].contiguous()


def _unscored_zeroed(logits: torch.Tensor, starts: tuple[int, ...], lengths: tuple[int, ...],
                     vocab_size: int) -> torch.Tensor:
    """An uninitialised gradient of the logits with 0 written where no chunk writes (positions outside each
    row's scoring range, the padded vocabulary): one pass over the `[B, S, V]` bf16 gradient fewer than
    zeroing it all first, when the chunks cover nearly all of it (SFT: every position but the last)."""
    grad = torch.empty_like(logits)
    seq = logits.shape[1]
    for rows, start, length, _ in _row_spans(starts, lengths):
        start = min(max(start, 0), seq) if length > 0 else seq  # a row with nothing scored: all zero
        grad[rows, :start].zero_()
        grad[rows, start + max(length, 0):].zero_()
    if vocab_size < logits.shape[2]:
        grad[..., vocab_size:].zero_()
    return grad


def _row_spans(starts: tuple[int, ...], lengths: tuple[int, ...]) -> list[tuple[slice, int, int, int]]:
    """(rows, first logits position, length, row count) of each scoring range: all rows together when they
    share start and length (one view of the logits), else row by row."""
    if len(set(starts)) == 1 and len(set(lengths)) == 1:
        return [(slice(None), starts[0], lengths[0], len(starts))]
    return [(slice(b, b + 1), s, n, 1) for b, (s, n) in enumerate(zip(starts, lengths, strict=True))]


def _chunks(starts: tuple[int, ...], lengths: tuple[int, ...], vocab_size: int,
            chunk_size: int) -> Iterator[tuple[slice, int, int, int]]:
    """(rows, first logits position, first response step, steps) of each chunk of each `_row_spans` range."""
    for rows, start, length, count in _row_spans(starts, lengths):
        step = chunk_size if chunk_size > 0 else max(1, CHUNK_ELEMENTS // (count * vocab_size))
        for i in range(0, length, step):
            yield rows, start, i, min(step, length - i)


def _vocab_parallel_scores(scoring: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropies `[B, r]` from this tensor-parallel rank's vocabulary shard `[B, r, V/tp]`.

    Padded vocabulary columns become -inf (probability 0). The log-prob is megatron's vocab-parallel
    cross entropy, negated; the entropy H = log Z - E_p[z] is built from sums all-reduced over the
    tensor-parallel group (all-reduce forward, identity backward), so gradients reach every shard.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    width = scoring.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * width
    padded = torch.arange(first, first + width, device=scoring.device) >= vocab_size
    scoring = scoring.masked_fill(padded, float("-inf"))
    logp = -tensor_parallel.vocab_parallel_cross_entropy(scoring.clone(), targets)
    if not with_entropy:
        return logp, None
    peak = scoring.detach().amax(dim=-1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    weights = torch.exp(scoring - peak.unsqueeze(-1))  # unnormalised p, 0 on padded columns
    total = tensor_parallel.reduce_from_tensor_model_parallel_region(weights.sum(dim=-1))
    expected = tensor_parallel.reduce_from_tensor_model_parallel_region(
        (weights * scoring.masked_fill(padded, 0.0)).sum(dim=-1))
    return logp, torch.log(total) + peak - expected / total


def rows_to_host(rows: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Per-sample 1-D device tensors as float32 CPU tensors (None stays None: a pipeline stage that scored
    nothing), in one transfer: a copy per row would make the host wait for each micro-batch's forward
    before launching the next one."""
    present = [row.reshape(-1) for row in rows if row is not None]
    if not present:
        return list(rows)
    parts = iter(torch.cat(present).float().cpu().split([row.numel() for row in present]))
    return [None if row is None else next(parts).clone() for row in rows]


@dataclass
class SampleLogProbs:
    """Per-sample response log-probs (and entropies), 1-D float32 CPU tensors of `response_length`."""

    log_probs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    routed_experts: list[torch.Tensor] | None = None  # record_routing: each sample's [len(tokens) - 1, L, k] experts


def compute_log_probs(models: list[torch.nn.Module], samples: list[Sample], *, vocab_size: int,
                      temperature: float = 1.0, with_entropy: bool = False, micro_batch_size: int = 1,
                      use_dynamic_batch_size: bool = False, max_tokens_per_gpu: int | None = None,
                      pad_token_id: int = 0, pad_multiple: int = 1, chunk_size: int = -1,
                      compile_scores: bool | None = None, fp32_logits: bool = False,
                      profile: Callable[[Iterator[Any]], Iterator[Any]] | None = None,
                      workload: Callable[[int], float] | None = None,
                      routed_experts: list[torch.Tensor] | None = None,
                      record_routing: bool = False) -> SampleLogProbs:
    """Forward-only response log-probs of `samples` (in their order) under `models`, no gradients;
    `profile` wraps the iteration over micro-batches (`TrainProfiler.iterate`); `fp32_logits`: see `forward_logits`.
    MoE routing replay (routing_replay.py; the models built with it): `routed_experts` (one [len(tokens) - 1, L, k]
    record per sample) are the experts every router uses; `record_routing` returns the experts they chose, on this
    rank's layers (-1 in the others)."""
    parts = micro_batches([len(s.tokens) for s in samples], micro_batch_size=micro_batch_size,
                          use_dynamic_batch_size=use_dynamic_batch_size, max_tokens_per_gpu=max_tokens_per_gpu,
                          workload=workload)
    device = next(models[0].parameters()).device
    check_expert_parallel_counts(len(parts), device)

    padded: dict[int, PaddedBatch] = {}  # id(indices) -> its batch, from `run` to `collect`
    routers = routing_replay.require_routers(models) if routed_experts is not None or record_routing else None
    recorded: list[torch.Tensor | None] = [None] * len(samples)

    def run(model: torch.nn.Module, indices: list[int]) -> torch.Tensor:
        batch = padded[id(indices)] = pad_samples([samples[i] for i in indices], pad_token_id, device, pad_multiple)
        width = batch.tokens.shape[1]
        if routed_experts is not None:
            routing_replay.replay_forward(routers, routing_replay.micro_batch_ids(
                [routed_experts[i] for i in indices], width, routers, device))
        elif record_routing:
            routing_replay.start_recording(routers)
        logits = forward_logits(model, batch, fp32=fp32_logits)
        if record_routing and routed_experts is None:
            lengths = [len(samples[i].tokens) for i in indices]
            for i, record in zip(indices, routing_replay.recorded_records(routers, lengths, width), strict=True):
                recorded[i] = record
        routing_replay.clear(routers)  # nothing kept for the next micro-batch (no backward here)
        return logits

    def collect(indices: list[int], logits: torch.Tensor) -> tuple[list[int], PaddedBatch, tuple]:
        batch = padded.pop(id(indices))
        out = score_logits(logits, batch, vocab_size=vocab_size, temperature=temperature,
                           with_entropy=with_entropy, chunk_size=chunk_size, compile_scores=compile_scores)
        return indices, batch, out

    log_probs: list[torch.Tensor | None] = [None] * len(samples)
    entropies: list[torch.Tensor | None] = [None] * len(samples)
    with routing_replay.cleared_after(routers):
        results = forward_only(models, parts, run, collect, wrap=profile)
    for indices, batch, (logp, _, entropy) in results:
        for row, i in enumerate(indices):
            n = batch.host_response_lengths[row]
            log_probs[i] = logp[row, :n]
            if entropy is not None:
                entropies[i] = entropy[row, :n]
    log_probs = rows_to_host(log_probs)  # once for all micro-batches, after the last one's work is queued
    entropies = rows_to_host(entropies) if with_entropy else entropies
    if pipeline_size() > 1:  # the last stage scored them; every stage returns them
        lengths = [s.response_length for s in samples]
        last = is_last_stage()
        log_probs = share_from_last_stage(log_probs if last else None, lengths, device)
        if with_entropy:
            entropies = share_from_last_stage(entropies if last else None, lengths, device)
    return SampleLogProbs(log_probs, entropies if with_entropy else None,
                          recorded if record_routing and routed_experts is None else None)
