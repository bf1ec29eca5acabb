"""What the scheduler (`scheduler.py`) runs: a request and its progress, the running rows of either KV cache
(`_Batch` over a `DynamicCache`, `_SlotBatch` over the slot cache), and the `transformers` forward's padded
inputs and call.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from slime.engines.builtin.sampling import SamplingParams


@dataclass
class Request:
    """One generation request and its progress."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    rng: random.Random  # this request's own random stream: its samples do not depend on the batch
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    logprob_start_len: int = -1  # >= 0: also score the prompt from this position (SGLang's field)
    input_logprobs: list[float | None] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    matched_stop: str | None = None
    abort_requested: bool = False
    # set by `submit`: a token in `stop_ids` or reaching `limit` tokens may end the request (the
    # per-token fast check of `_choose`; `_check_stop` decides)
    stop_ids: frozenset[int] = frozenset()
    limit: int = 0
    # SGLang's return_routed_experts: one host int32 record [n, L, k] per forward that fed this request tokens
    # (its prompt's prefill, then each decode), in token order; answered from `routed_experts_start_len` on
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed_experts: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Batch:
    """Running rows: their requests, the shared cache and the validity mask of its columns."""

    requests: list[Request]
    cache: DynamicCache
    mask: torch.Tensor  # [B, T] long: 1 where the cache column holds a real token of that row
    next_tokens: torch.Tensor  # [B] the token each row feeds at the next decode step


@dataclass
class _SlotBatch:
    """Running rows in slot mode: row i is slot i and holds `lengths[i]` tokens."""

    requests: list[Request]
    next_tokens: torch.Tensor  # [B]
    lengths: list[int]
    # logits [B, V] of the decode already launched with `next_tokens` (whose positions `lengths`
    # already counts), or None: see `SlotCachePath._decode_slots` (scheduler_slots.py)
    pending: torch.Tensor | None = None
    pending_routing: torch.Tensor | None = None  # that decode's routed experts [B, L, k] (MoE models)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width == 0:
        return t
    shape = list(t.shape)
    shape[dim] = width
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and position ids [B, width] of `prompts` left-padded (with 0) to the longest,
    built on the host and copied to `device`: the `transformers` prefill's inputs."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)


def transformers_forward(model: Any, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                         cache: DynamicCache, all_positions: bool = False) -> torch.Tensor:
    """The `transformers` model's fp32 logits [B, V] of the last position, or [B, T, V] of every position when
    asked, its keys/values appended to `cache`."""
    # without padding the mask says nothing: leaving it out lets attention skip building one
    mask = None if bool(mask.all()) else mask
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=0 if all_positions else 1)
    return out.logits.float() if all_positions else out.logits[:, -1, :].float()

