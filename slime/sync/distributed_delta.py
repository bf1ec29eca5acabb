"""Delta weight sync over the distributed transport (`--update-weight-mode delta`, weight_sync_mode
distributed): each sync broadcasts only the tensors whose bytes changed since the last sync.

Changed or not is decided per HF tensor name against a key of the bytes last sent, without keeping a
second copy of the model. A CPU tensor (gloo) is keyed by the configured checksum of its bytes, read in
place (xxh3-128 hashes ~20 GB/s on one core). A GPU tensor is keyed by `fingerprint`, computed on the GPU
so that unchanged tensors are never copied to the host: two wrapping int64 sums over the tensor's bytes
read as int32 words, one plain and one weighted by position. That is a linear fingerprint, not a
cryptographic hash: one changed word always changes it; several changes go unnoticed only if they cancel
exactly in both sums. The dtype and shape are part of the key.

Tensors that are sent carry the configured checksum (`--update-weight-delta-checksum`; for GPU tensors
computed on a host copy of those tensors only) in an extra `checksums` field of
`/update_weights_from_distributed`;
the built-in engine checks every received tensor against it before applying any and answers
`checksums_verified`. SGLang's request struct ignores fields it does not know, so an SGLang engine
applies the update unverified; the syncer logs that once per engine.

Whole tensors are sent, not byte deltas (`--update-weight-delta-encoding` is the disk delta's): the
engine must hold the base to apply an XOR, which SGLang's endpoint cannot. The first sync, a sync after a
failure and a sync after the engine set changed send everything.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from slime.delta_codec import checksum, host_bytes
from slime.sync.common import NamedTensors, SyncResult

logger = logging.getLogger(__name__)

CHUNK = 1 << 22  # words per step of the fingerprint: bounds its temporary memory (3 int64 buffers)
MULTIPLIER = 0x9E3779B1  # odd: position weights (i * MULTIPLIER + 1) are distinct modulo 2**64

Key = tuple[str, tuple[int, ...], object]


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums (on the tensor's device) over its bytes as int32 words (bytes when it has no
    whole number of aligned words): sum(w) and sum(w * (i * MULTIPLIER + 1)), both wrapping."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    try:
        words = raw.view(torch.int32)
    except RuntimeError:  # a byte count or storage offset that is not a multiple of 4
        words = raw
    total = torch.zeros(2, dtype=torch.int64, device=raw.device)
    for start in range(0, words.numel(), CHUNK):
        chunk = words[start:start + CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=raw.device)
        weights.mul_(MULTIPLIER).add_(1)
        total[0] += chunk.sum()
        total[1] += (chunk * weights).sum()
    return total




class DeltaFilter:
    """Trainer rank 0's record of what the engines hold: per HF tensor name the key of the bytes last sent."""

    def __init__(self, algorithm: str = "xxh3-128") -> None:
        self.algorithm = algorithm
        self.sent: dict[str, Key] | None = None  # None: the engines' weights are unknown, send everything
        self._pending: dict[str, Key] = {}
        self._digests: dict[str, str] = {}  # this sync's checksums computed while selecting (CPU tensors)

    def key(self, name: str, tensor: torch.Tensor) -> Key:
        """What "unchanged" compares: dtype, shape and, for a CPU tensor, the configured checksum of its bytes
        (read in place, and kept for sending); for a GPU tensor the device-side `fingerprint` (no host copy)."""
        if tensor.device.type == "cpu":
            self._digests[name] = checksum(host_bytes(tensor), self.algorithm)
            content: object = self._digests[name]
        else:
            content = tuple(fingerprint(tensor).tolist())
        return str(tensor.dtype), tuple(tensor.shape), content

    def select(self, weights: NamedTensors, result: SyncResult) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors to send: all of them on a full sync, else those whose key changed (the others are
        counted in `result.skipped`)."""
        self._pending, self._digests = {}, {}
        full = self.sent is None
        for name, tensor in weights:
            self._pending[name] = self.key(name, tensor)
            if full or self.sent.get(name) != self._pending[name]:
                yield name, tensor
            else:
                result.skipped += 1

    def checksums(self, names: list[str], tensors: list[torch.Tensor]) -> list[str]:
        """The configured checksum of each sent tensor's bytes (taken while selecting for CPU tensors; a host
        copy of GPU tensors)."""
        return [self._digests.get(name) or checksum(host_bytes(t), self.algorithm)
                for name, t in zip(names, tensors, strict=True)]

    def commit(self) -> None:
        """Every engine took the sync: what was selected is what they hold."""
        self.sent, self._pending = self._pending, {}

    def reset(self) -> None:
        """A failed sync or a new engine set: the engines' weights are unknown, so the next sync is full."""
        self.sent, self._pending = None, {}
