"""The routed experts of a MoE rollout (slime's rollout routing replay, R3): asked of the engine, kept on the sample.

With `return_routed_experts` a `/generate` answer's `meta_info["routed_experts"]` is SGLang's encoding of the
experts every fed token was routed to: base64 of a little-endian int32 C-order array [rows, num_layers, topk] with
rows = len(prompt + output) - 1 (the last output token is never fed), from `routed_experts_start_len` on when the
request gave one (echoed in meta_info). slime decodes it with `np.frombuffer(...).reshape(len(tokens) - 1,
num_layers, topk)` and keeps the array; here `Sample.rollout_routed_experts` holds one list of num_layers * topk
int32s per token (the shard schema's `list<list<int32>>`, slime/storage/schema.py). The row width is read from the
payload (its size over the rows), so no model shape needs to be known here.

Every model turn sends the whole sample so far (`multiturn.generate_turn`), so its answer covers the whole
sequence and replaces the previous record (slime likewise overwrites); with a start offset the rows before it are
kept from the previous turn.

Whether to ask is slime's `--use-rollout-routing-replay` (`wants_routed_experts`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from slime.errors import DataFormatError
from slime.types import Sample


def wants_routed_experts(args: Any) -> bool:
    """Whether generate calls ask the engines for routed experts: slime's `use_rollout_routing_replay`."""
    return bool(getattr(args, "use_rollout_routing_replay", False))


def decode_routed_experts(encoded: str, rows: int) -> list[list[int]]:
    """SGLang's `meta_info["routed_experts"]` -> `rows` lists of num_layers * topk expert ids (token order)."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise DataFormatError(f"routed_experts is not base64 ({exc})") from None
    ids = np.frombuffer(raw, dtype="<i4")
    if rows < 0 or (rows == 0 and ids.size) or (rows and ids.size % rows):
        raise DataFormatError(f"routed_experts holds {ids.size} int32 ids, not a whole number of ids for each of "
                              f"{rows} tokens (len(tokens) - 1 less routed_experts_start_len)")
    return ids.reshape(rows, -1).astype(np.int32).tolist() if rows else []


def apply_routed_experts(sample: Sample, meta_info: dict[str, Any]) -> None:
    """Set `sample.rollout_routed_experts` from a `/generate` meta_info (after the turn's tokens were appended):
    rows [start, len(tokens) - 1) from the answer, rows before `start` kept from the previous record. Nothing
    to do when the answer holds none."""
    encoded = meta_info.get("routed_experts")
    if encoded is None:
        return
    start = int(meta_info.get("routed_experts_start_len") or 0)
    kept = sample.rollout_routed_experts or []
    if start > len(kept):
        raise DataFormatError(f"sample {sample.index}: routed_experts start at token {start}, but only {len(kept)} "
                              "tokens' routing is recorded before it")
    rows = len(sample.tokens) - 1 - start
    sample.rollout_routed_experts = kept[:start] + decode_routed_experts(encoded, rows)
