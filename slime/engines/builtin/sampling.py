"""Sampling parameters (SGLang's names) and the batched sampler of the built-in engine.

The log-prob reported for a token is its log-probability under the distribution it was actually
drawn from: logits / temperature, then top-k and top-p truncation, renormalised. With the default
top_p=1, top_k=-1 that is `log_softmax(logits / T)`, exactly what the trainer recomputes, so train
and rollout log-probs agree. Greedy rows (temperature 0) report `log_softmax(logits)`.

Tokens are drawn by inverse CDF: one uniform number per row, taken from that request's own
`random.Random` (seeded by `sampling_seed`, or from the engine's seed and the request's arrival
number), located in the row's cumulative distribution with one vectorised `searchsorted`. So a
request's samples do not depend on what else is in the batch, and a step costs a few batched tensor
ops instead of one random-number kernel per row (measured: 0.9 ms of 1.4 ms per step for 64 rows
on CPU went to per-row `exponential_` noise). On CUDA the engine runs that common path (no top-k,
top-p or greedy row) compiled (`compiled_draw`, `--disable-sampler-compile` to turn it off): the
same function, the same draws.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from slime.errors import SlimeError


class BadRequestError(SlimeError, ValueError):
    """A request the engine refuses (HTTP 400), with a message naming the field."""


# Known SGLang sampling fields the built-in engine does not implement: accepted only at their
# neutral value, so a request relying on them fails loudly instead of being sampled differently.
_NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
}
# Accepted and ignored: they change nothing in a non-streaming, single-sample response.
_IGNORED = {"stream_interval", "spaces_between_special_tokens"}


@dataclass
class SamplingParams:
    """The subset of SGLang's `SamplingParams` that the built-in engine implements."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_request(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """Validate a request's `sampling_params` dict; every problem names its field."""
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        for name in list(raw):
            if name in _IGNORED:
                raw.pop(name)
            elif name in _NEUTRAL:
                value = raw.pop(name)
                if value is not None and value != _NEUTRAL[name]:
                    raise BadRequestError(
                        f"sampling_params.{name}={value!r} is not supported by the built-in engine "
                        f"(only {_NEUTRAL[name]!r}); use engine: sglang"
                    )
            elif name not in known:
                raise BadRequestError(f"unknown sampling_params field {name!r}; known: {sorted(known | set(_NEUTRAL))}")
        if isinstance(raw.get("stop"), str):
            raw["stop"] = [raw["stop"]]
        for name in ("stop", "stop_token_ids"):
            if raw.get(name) is None:
                raw.pop(name, None)
        params = cls(**raw)
        params._check()
        return params

    def _check(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise BadRequestError(f"sampling_params.{name}={getattr(self, name)!r}: {what}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens", "must be an integer >= 0")
        need(is_int(self.min_new_tokens) and self.min_new_tokens >= 0, "min_new_tokens", "must be an integer >= 0")
        need(isinstance(self.temperature, int | float) and self.temperature >= 0, "temperature", "must be >= 0")
        need(isinstance(self.top_p, int | float) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 or >= 1")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be a string or a list of non-empty strings")
        need(isinstance(self.stop_token_ids, list) and all(is_int(t) for t in self.stop_token_ids),
             "stop_token_ids", "must be a list of integers")
        need(self.sampling_seed is None or is_int(self.sampling_seed), "sampling_seed", "must be an integer")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            need(isinstance(getattr(self, name), bool), name, "must be true or false")


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    top_ks: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return (tokens [B], log-probs [B]) under the used distribution.

    Args:
        logits: [B, V] float32 or the model's dtype (read in float32: a bf16 step's logits are upcast
            inside the compiled draw instead of copied first), already masked where tokens are banned.
        temperatures, top_ps: [B] float32; top_ks: [B] int64 (-1 = off).
        uniforms: [B] float64 in [0, 1), one per row, from each request's own random stream.
        compiled: run the common path (`plain_draw`: no top-k / top-p, no greedy row, two rows or more)
            as one `torch.compile`d function (`compiled_draw`) instead of ~20 eager kernels.
    The four parameter tensors may live on the host: then deciding whether top-k / top-p apply
    costs no device synchronisation, and they are copied to the logits' device here.
    """
    vocab = logits.shape[1]
    top_k_on = bool(((top_ks > 0) & (top_ks < vocab)).any())
    top_p_on = bool((top_ps < 1).any())
    # decided on the host too: skip the passes over [B, V] that change nothing (RL samples at T = 1)
    any_greedy, all_greedy = bool((temperatures == 0).any()), bool((temperatures == 0).all())
    unscaled = bool((temperatures == 1).all())
    if not (top_k_on or top_p_on or any_greedy):  # the RL case: every row drawn from logits / T
        # one row stays eager: dynamo specialises a size-1 dimension, so it would compile a second
        # graph (mid-rollout, when the last request of a burst is alone), for a draw that costs little
        draw = compiled_draw() if compiled and logits.shape[0] > 1 else plain_draw
        # only what the draw reads goes to the device (at T = 1 everywhere: the uniforms alone)
        scale = None if unscaled else temperatures.to(logits.device, non_blocking=True)
        return draw(logits, uniforms.to(logits.device, non_blocking=True), scale)
    logits = logits.float()
    temperatures, top_ps, top_ks, uniforms = (t.to(logits.device, non_blocking=True)
                                              for t in (temperatures, top_ps, top_ks, uniforms))
    greedy = temperatures == 0
    scaled = logits if unscaled else logits / torch.where(greedy, torch.ones_like(temperatures),
                                                          temperatures).unsqueeze(1)
    k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), torch.full_like(top_ks, vocab))
    if top_k_on:
        kth = torch.topk(scaled, int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p_on:
        sorted_logits, order = torch.sort(scaled, dim=1, descending=True)
        probs = torch.softmax(sorted_logits, dim=1)
        # drop a token when the mass strictly before it already reaches top_p (the top one always stays)
        drop_sorted = (torch.cumsum(probs, dim=1) - probs) >= top_ps.unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop & (top_ps < 1).unsqueeze(1), float("-inf"))
    logprobs = torch.log_softmax(scaled, dim=1)
    if all_greedy:
        tokens = torch.argmax(scaled, dim=1)
    else:
        tokens = inverse_cdf(logprobs.exp(), uniforms)
        if any_greedy:
            tokens = torch.where(greedy, torch.argmax(scaled, dim=1), tokens)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def plain_draw(logits: torch.Tensor, uniforms: torch.Tensor,
               temperatures: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` when no row is greedy or truncated: (tokens, log-probs) of `logits / temperatures`
    (None: every temperature is 1, no division). Eager, or compiled whole by `compiled_draw`: the
    same function either way."""
    if torch.compiler.is_compiling():
        # the vocabulary is fixed for an engine: a constant in the graph, so `_block_size` runs once
        # while tracing (symbolic, its divisor search would guard on V % d for every candidate d)
        torch._dynamo.mark_static(logits, 1)
    logits = logits.float()  # a bf16 step's logits: upcast here (compiled: fused into the log-softmax's read)
    scaled = logits if temperatures is None else logits / temperatures.unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=1)
    tokens = inverse_cdf(logprobs.exp(), uniforms)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


@functools.cache
def compiled_draw() -> Any:
    """`plain_draw` compiled once per process, dynamic in the row count (one graph for 2..N rows, and
    one with temperatures, one without). Inductor fuses the division, log-softmax, exponential and
    float64 block sums, and recomputes the chosen block's probabilities from the stored log-probs (on
    CPU: 4 generated kernels, plus aten's cumsum and searchsorted twice each, against ~20 eager). Same
    operations as eager: the same tokens for the same uniforms unless a uniform falls within float
    rounding of a cumulative boundary, log-probs equal to float rounding."""
    from slime.compiled import compiled

    return compiled(plain_draw, "start the engine with --disable-sampler-compile for the eager sampler",
                    dynamic=True)


_BLOCK = 1024


@functools.lru_cache(maxsize=16)
def _block_size(vocab: int) -> int:
    """1024, or the divisor of the vocabulary in [512, 2048] nearest to it (Qwen2's 151936 = 128 x
    1187): with a divisor the probabilities need no padded copy at every step."""
    divisors = [d for d in range(_BLOCK // 2, 2 * _BLOCK + 1) if vocab % d == 0]
    return min(divisors, key=lambda d: abs(d - _BLOCK)) if divisors else _BLOCK


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds `u * total` (sums in float64).

    Two levels instead of one cumulative sum over the vocabulary: the block of ~1024 tokens (`_block_size`)
    holding the target is found from per-block masses, then the token inside it. Same draw up to float64
    rounding, ~4x less memory traffic over a 150k vocabulary (the sampler was a fifth of a decode
    step at 256 rows on a GPU). Zero-probability tokens never become the first to exceed the target;
    if rounding would push past a block's last possible token, that token is taken.
    """
    rows, vocab = probs.shape
    # compiled (`compiled_draw`): the divisor search is traced, as dynamo ignores the lru cache anyway
    size = _block_size.__wrapped__(vocab) if torch.compiler.is_compiling() else _block_size(vocab)
    blocks = -(-vocab // size)
    if blocks * size != vocab:
        probs = torch.nn.functional.pad(probs, (0, blocks * size - vocab))
    per_block = probs.view(rows, blocks, size)
    block_cdf = per_block.sum(dim=2, dtype=torch.float64).cumsum(dim=1)  # [rows, blocks]
    targets = uniforms.to(block_cdf) * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, targets.unsqueeze(1), right=True).squeeze(1).clamp(max=blocks - 1)
    before = block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before = torch.where(block > 0, before, torch.zeros_like(before))
    inner = per_block[torch.arange(rows, device=probs.device), block].double().cumsum(dim=1)  # [rows, size]
    index = torch.searchsorted(inner, (targets - before).unsqueeze(1), right=True).squeeze(1)
    last_possible = (inner < inner[:, -1:]).sum(dim=1)  # the block's last token with probability > 0
    return block * size + torch.minimum(index, last_possible)
