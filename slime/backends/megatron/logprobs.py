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
With tensor parallelism the logits are vocab-sharded; each rank scores with all-reduced sums over the
tensor-parallel group (`_vocab_parallel_scores`). With `chunk_size` > 0 (slime's --log-probs-chunk-size)
the response positions are scored `chunk_size` at a time, so the softmax over the vocabulary never
holds more than `[B, chunk_size, V]` at once; the values do not change.

`compute_log_probs` runs this forward-only over micro-batches (fixed size or packed by tokens) for the
reference model, the old policy and tests, and returns one response-aligned tensor per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from slime.algorithms.policy_loss import entropy_from_logits
from slime.backends.megatron.batching import micro_batches
from slime.backends.megatron.forward import forward_only, is_last_stage, pipeline_size, share_from_last_stage
from slime.errors import ConfigError
from slime.types import Sample


@dataclass
class PaddedBatch:
    """Samples as one right-padded token batch, with what is needed to find each response."""

    tokens: torch.Tensor  # [B, S] long, right-padded
    prompt_lengths: torch.Tensor  # [B] long
    response_lengths: torch.Tensor  # [B] long

    @property
    def max_response_length(self) -> int:
        return int(self.response_lengths.max()) if len(self.response_lengths) else 0


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
    response = torch.tensor([s.response_length for s in samples], dtype=torch.long)
    prompt = torch.tensor([len(s.tokens) for s in samples], dtype=torch.long) - response
    return PaddedBatch(tokens.to(device), prompt.to(device), response.to(device))


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


def forward_logits(model: torch.nn.Module, batch: PaddedBatch) -> torch.Tensor:
    """The model's logits `[B, S, V_padded]` (vocab-sharded under tensor parallelism) for the batch."""
    seq = batch.tokens.shape[1]
    position_ids = torch.arange(seq, device=batch.tokens.device).unsqueeze(0).expand_as(batch.tokens)
    return model(input_ids=batch.tokens, position_ids=position_ids, attention_mask=None)


def score_logits(logits: torch.Tensor, batch: PaddedBatch, *, vocab_size: int, temperature: float = 1.0,
                 with_entropy: bool = False,
                 chunk_size: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` from the logits of `forward_logits`: the part the train step may recompute in
    the backward pass instead of keeping its activations (slime's --recompute-loss-function)."""
    from megatron.core import parallel_state

    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0 to score tokens, got {temperature}")
    seq = batch.tokens.shape[1]
    positions, mask = response_positions(batch)
    targets = batch.tokens.gather(1, (positions + 1).clamp(max=seq - 1))
    # only the scoring positions: [B, R_max, V(_local)], temperature-scaled
    scoring = logits.gather(1, positions.unsqueeze(2).expand(-1, -1, logits.shape[2])).float() / temperature
    parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    width = scoring.shape[1]
    step = chunk_size if chunk_size > 0 else max(width, 1)
    pieces = [_scores(scoring[:, i:i + step], targets[:, i:i + step], vocab_size, with_entropy, parallel)
              for i in range(0, width, step)] or [_scores(scoring, targets, vocab_size, with_entropy, parallel)]
    logp = torch.cat([p[0] for p in pieces], dim=1)
    entropy = torch.cat([p[1] for p in pieces], dim=1) if with_entropy else None
    logp = torch.where(mask, logp, 0.0)
    entropy = torch.where(mask, entropy, 0.0) if with_entropy else None
    return logp, mask, entropy


def _scores(scoring: torch.Tensor, targets: torch.Tensor, vocab_size: int, with_entropy: bool,
            parallel: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) `[B, r]` of `targets` under the temperature-scaled logits `[B, r, V(_local)]`."""
    if parallel:
        return _vocab_parallel_scores(scoring, targets, vocab_size, with_entropy)
    scoring = scoring[..., :vocab_size]  # the real vocabulary only
    logp = torch.log_softmax(scoring, dim=-1).gather(2, targets.unsqueeze(2)).squeeze(2)
    return logp, entropy_from_logits(scoring) if with_entropy else None


def _vocab_parallel_scores(scoring: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropies `[B, R]` from this tensor-parallel rank's vocabulary shard `[B, R, V/tp]`.

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


@dataclass
class SampleLogProbs:
    """Per-sample response log-probs (and entropies), 1-D float32 CPU tensors of `response_length`."""

    log_probs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None


def compute_log_probs(models: list[torch.nn.Module], samples: list[Sample], *, vocab_size: int,
                      temperature: float = 1.0, with_entropy: bool = False, micro_batch_size: int = 1,
                      use_dynamic_batch_size: bool = False, max_tokens_per_gpu: int | None = None,
                      pad_token_id: int = 0, pad_multiple: int = 1, chunk_size: int = -1,
                      profile: Callable[[Iterator[Any]], Iterator[Any]] | None = None,
                      workload: Callable[[int], float] | None = None) -> SampleLogProbs:
    """Forward-only response log-probs of `samples` (in their order) under `models`, no gradients;
    `profile` wraps the iteration over micro-batches (`TrainProfiler.iterate`)."""
    parts = micro_batches([len(s.tokens) for s in samples], micro_batch_size=micro_batch_size,
                          use_dynamic_batch_size=use_dynamic_batch_size, max_tokens_per_gpu=max_tokens_per_gpu,
                          workload=workload)
    device = next(models[0].parameters()).device

    padded: dict[int, PaddedBatch] = {}  # id(indices) -> its batch, from `run` to `collect`

    def run(model: torch.nn.Module, indices: list[int]) -> torch.Tensor:
        batch = padded[id(indices)] = pad_samples([samples[i] for i in indices], pad_token_id, device, pad_multiple)
        return forward_logits(model, batch)

    def collect(indices: list[int], logits: torch.Tensor) -> tuple[list[int], PaddedBatch, tuple]:
        batch = padded.pop(id(indices))
        out = score_logits(logits, batch, vocab_size=vocab_size, temperature=temperature,
                           with_entropy=with_entropy, chunk_size=chunk_size)
        return indices, batch, out

    log_probs: list[torch.Tensor | None] = [None] * len(samples)
    entropies: list[torch.Tensor | None] = [None] * len(samples)
    for indices, batch, (logp, _, entropy) in forward_only(models, parts, run, collect, wrap=profile):
        for row, i in enumerate(indices):
            n = int(batch.response_lengths[row])
            log_probs[i] = logp[row, :n].float().cpu()
            if entropy is not None:
                entropies[i] = entropy[row, :n].float().cpu()
    if pipeline_size() > 1:  # the last stage scored them; every stage returns them
        lengths = [s.response_length for s in samples]
        last = is_last_stage()
        log_probs = share_from_last_stage(log_probs if last else None, lengths, device)
        if with_entropy:
            entropies = share_from_last_stage(entropies if last else None, lengths, device)
    return SampleLogProbs(log_probs, entropies if with_entropy else None)
