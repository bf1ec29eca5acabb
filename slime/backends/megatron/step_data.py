"""The per-sample arrays a train step consumes, and their assembly into padded micro-batch tensors.

What the rollout produced lives on `Sample` (tokens, loss mask, rollout log-probs, a scalar advantage
in `metadata["advantage"]`) and is what rollout shards store. What the trainer computes between rollout
and step (reference and old-policy log-probs, critic values, per-token advantages and returns; slime
keeps them in its `rollout_data` dict) is recomputed from the shard on every run, so it travels beside
the samples in `TrainArrays` rather than on `Sample`: the shard schema stays unchanged.

Every array entry is response-aligned: one value per response token (`Sample.response_length`), given
as a list, a 1-D tensor, or, for advantages only, a scalar broadcast to the sample's tokens. The exception is
`routed_experts`, the MoE routing the train step replays (routing_replay.py): one row of experts per fed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from slime.backends.megatron.logprobs import PaddedBatch, pad_samples, to_device
from slime.errors import DataFormatError
from slime.types import Sample

PerSample = Sequence[float] | torch.Tensor


@dataclass
class TrainArrays:
    """Trainer-computed per-sample arrays, each a list aligned with the step's samples (or None)."""

    advantages: list[float | PerSample] | None = None  # None: Sample.metadata["advantage"]
    returns: list[PerSample] | None = None  # value-loss targets (ppo)
    old_log_probs: list[PerSample] | None = None  # behaviour policy, recomputed by the trainer
    ref_log_probs: list[PerSample] | None = None  # reference model, for the KL loss
    old_values: list[PerSample] | None = None  # critic values when the advantages were computed
    # experts to replay (R3: the rollout's, R2: the old-log-prob pass's), [len(tokens) - 1, L, k] int per sample
    routed_experts: list[torch.Tensor] | None = None

    def check(self, samples: list[Sample]) -> None:
        """Every given array has one entry per sample and one value per response token (one row per fed token for
        `routed_experts`, whose rows routing_replay.py checks)."""
        for f in fields(self):
            column = getattr(self, f.name)
            if column is None:
                continue
            if len(column) != len(samples):
                raise DataFormatError(f"TrainArrays.{f.name} has {len(column)} entries for {len(samples)} samples")
            if f.name == "routed_experts":
                for sample, value in zip(samples, column, strict=True):
                    if len(value) != len(sample.tokens) - 1:
                        raise DataFormatError(f"sample index={sample.index}: TrainArrays.routed_experts has "
                                              f"{len(value)} rows but the sample feeds {len(sample.tokens) - 1} "
                                              "tokens (len(tokens) - 1)")
                continue
            for sample, value in zip(samples, column, strict=True):
                if f.name == "advantages" and isinstance(value, int | float):
                    continue
                if len(value) != sample.response_length:
                    raise DataFormatError(f"sample index={sample.index}: TrainArrays.{f.name} has {len(value)} "
                                          f"values but response_length={sample.response_length}")


@dataclass
class MicroBatch:
    """Padded `[b, R]` tensors (R = longest response in the micro-batch) for a subset of the samples."""

    indices: list[int]  # positions of its samples in the step's sample list
    batch: PaddedBatch
    loss_mask: torch.Tensor  # bool: response token and Sample.loss_mask
    advantages: torch.Tensor
    rollout_log_probs: torch.Tensor | None
    old_log_probs: torch.Tensor | None
    ref_log_probs: torch.Tensor | None
    returns: torch.Tensor | None
    old_values: torch.Tensor | None
    rollout_rows: torch.Tensor | None = None  # bool [b]: rows whose sample carries rollout log-probs
    routed_experts: dict[int, torch.Tensor] | None = None  # layer -> [S_local * b, k] ids to replay (routing_replay)


def _rows(values: list, width: int, device: torch.device) -> torch.Tensor:
    """Right-pad response-aligned entries (scalars broadcast over the row's `lengths`) to `[b, width]`."""
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for row, (value, n) in enumerate(values):
        if isinstance(value, int | float):
            out[row, :n] = float(value)
        elif n:
            out[row, :n] = torch.as_tensor(value, dtype=torch.float32).detach().cpu()
    return to_device(out, device)


def build_micro_batch(samples: list[Sample], indices: list[int], arrays: TrainArrays, *, pad_token_id: int,
                      device: torch.device, pad_multiple: int = 1) -> MicroBatch:
    """The tensors of micro-batch `indices` (token width a multiple of `pad_multiple`); arrays must have
    passed `TrainArrays.check`."""
    chunk = [samples[i] for i in indices]
    batch = pad_samples(chunk, pad_token_id, device, pad_multiple)
    width = batch.max_response_length
    lengths = [s.response_length for s in chunk]
    loss_mask = torch.zeros(len(chunk), width, dtype=torch.bool)
    for row, sample in enumerate(chunk):
        if sample.loss_mask is not None:
            loss_mask[row, : sample.response_length] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        else:
            loss_mask[row, : sample.response_length] = True

    def column(name: str) -> torch.Tensor | None:
        values = getattr(arrays, name)
        return None if values is None else _rows([(values[i], n) for i, n in zip(indices, lengths, strict=True)],
                                                 width, device)

    advantages = column("advantages")
    if advantages is None:
        advantages = _rows([(float((s.metadata or {}).get("advantage", 0.0)), s.response_length) for s in chunk],
                           width, device)
    rollout, rollout_rows = None, None
    if any(s.rollout_log_probs is not None for s in chunk):  # rows without them are zeros (rollout_rows: False)
        rollout = _rows([(0.0 if s.rollout_log_probs is None else s.rollout_log_probs, s.response_length)
                         for s in chunk], width, device)
        rollout_rows = to_device(torch.tensor([s.rollout_log_probs is not None for s in chunk]), device)
    return MicroBatch(indices=list(indices), batch=batch, loss_mask=to_device(loss_mask, device), advantages=advantages,
                      rollout_log_probs=rollout, old_log_probs=column("old_log_probs"),
                      ref_log_probs=column("ref_log_probs"), returns=column("returns"),
                      old_values=column("old_values"), rollout_rows=rollout_rows)


def stack_rows(samples: list[Sample], rows: list[PerSample] | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per-sample response arrays as the `[B, T]` layout of `slime.algorithms` (T = longest response),
    with the mask of trained tokens (`loss_mask`); `rows=None` gives the mask alone."""
    width = max((s.response_length for s in samples), default=0)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, s in enumerate(samples):
        mask[row, : s.response_length] = (torch.tensor(s.loss_mask, dtype=torch.bool) if s.loss_mask is not None
                                          else True)
    if rows is None:
        return None, mask
    return _rows([(value, s.response_length) for value, s in zip(rows, samples, strict=True)], width,
                 torch.device("cpu")), mask


def split_rows(values: torch.Tensor, samples: list[Sample]) -> list[torch.Tensor]:
    """`[B, T]` rows back to per-sample 1-D float32 CPU tensors of each response's length."""
    values = values.detach().float().cpu()
    return [values[row, : s.response_length].clone() for row, s in enumerate(samples)]
