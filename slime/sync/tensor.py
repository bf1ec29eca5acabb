"""Tensor mode (colocated): buckets through `/update_weights_from_tensor`, nothing written to disk.

The body is SGLang's: `serialized_named_tensors` holds, per engine tensor-parallel rank, the base64
text of a `ForkingPickler` dump of `[(name, tensor), ...]` (SGLang's `MultiprocessingSerializer`
format, load_format null). The dump carries handles, not data: each bucket is first copied into one
flat buffer per dtype, which on CPU lives in shared memory (`file_system` sharing strategy, so an
unrelated engine process can map it by name) and on GPU is device memory shared by CUDA IPC handle
(the engine must be on the same GPU). The buffer is kept alive until every engine has answered,
since the engines copy from it while handling the request.
"""

from __future__ import annotations

import base64
import io
from collections import defaultdict
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

from slime.engines.client import EngineClient
from slime.sync.common import NamedTensors, SyncResult, Timer, buckets, nbytes, post_all


def _fresh_buffer(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    flat = torch.empty(numel, dtype=dtype, device=device)
    if device.type == "cpu":
        flat.share_memory_()  # allocated in shared memory before the copy: the data is copied once
    return flat


def pack_bucket(bucket: list[tuple[str, torch.Tensor]],
                allocate: Callable[[torch.device, torch.dtype, int], torch.Tensor] = _fresh_buffer,
                ) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """The bucket as views into one shareable flat buffer per (device, dtype) from `allocate`, and
    those buffers."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, (_, tensor) in enumerate(bucket):
        groups[(tensor.device, tensor.dtype)].append(i)
    views: list[tuple[str, torch.Tensor] | None] = [None] * len(bucket)
    flats = []
    for (device, dtype), indices in groups.items():
        total = sum(bucket[i][1].numel() for i in indices)
        flat = allocate(device, dtype, total)
        offset = 0
        for i in indices:
            name, tensor = bucket[i]
            view = flat[offset : offset + tensor.numel()].view(tensor.shape)
            view.copy_(tensor.detach())
            views[i] = (name, view)
            offset += tensor.numel()
        flats.append(flat)
    return [v for v in views if v is not None], flats


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """base64 ForkingPickler dump of `named` (tensors already shareable), as SGLang expects it."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class _FileSystemSharing:
    """`file_system` sharing strategy while packing and pickling CPU tensors (process-global, restored)."""

    def __enter__(self) -> None:
        self.previous = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")

    def __exit__(self, *exc: object) -> None:
        mp.set_sharing_strategy(self.previous)


class TensorSync:
    """Buckets of `buffer_size` bytes to every engine; the version is set with the last bucket."""

    def __init__(self, buffer_size: int, engine_tp_size: int = 1) -> None:
        self.buffer_size = buffer_size
        self.engine_tp_size = engine_tp_size
        self._host: dict[torch.dtype, torch.Tensor] = {}  # shared-memory buffers reused bucket after bucket

    def _allocate(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """CPU: a slice of this sync's shared-memory buffer of `dtype` (a new shared-memory file costs
        ~25 ms; the engines have copied a bucket before the next is packed). GPU: fresh memory, freed
        after the bucket, so colocated training keeps its memory."""
        if device.type != "cpu":
            return _fresh_buffer(device, dtype, numel)
        buffer = self._host.get(dtype)
        if buffer is None or buffer.numel() < numel:  # grown geometrically, up to one bucket
            limit = max(numel, self.buffer_size // dtype.itemsize)
            size = min(limit, max(numel, 2 * (buffer.numel() if buffer is not None else 0)))
            buffer = self._host[dtype] = _fresh_buffer(device, dtype, size)
        return buffer[:numel]

    async def send(self, client: EngineClient, urls: list[str], weights: NamedTensors, version: str,
                   result: SyncResult, timer: Timer, state: str) -> None:
        try:
            await self._send(client, urls, weights, version, result, timer, state)
        finally:
            self._host.clear()  # shared memory is not held between syncs

    async def _send(self, client: EngineClient, urls: list[str], weights: NamedTensors, version: str,
                    result: SyncResult, timer: Timer, state: str) -> None:
        source = iter(buckets(weights, self.buffer_size))
        pending = None
        while True:
            with timer("export"):
                bucket = next(source, None)
            if pending is not None:  # sent once the next bucket is known, so the last carries the version
                await self._post(client, urls, *pending, None if bucket is not None else version,
                                 result, timer, state)
            if bucket is None:
                return
            with timer("pack"), _FileSystemSharing():  # the previous bucket is applied: its buffer is free
                named, flats = pack_bucket(bucket, self._allocate)
            pending = (named, flats, bucket)

    async def _post(self, client: EngineClient, urls: list[str], named: list[tuple[str, torch.Tensor]],
                    flats: list[torch.Tensor], bucket: list[tuple[str, torch.Tensor]], version: str | None,
                    result: SyncResult, timer: Timer, state: str) -> None:
        # One dump per receiving rank: each dump takes a reference on the shared-memory file that the
        # receiver gives back once it has mapped it; a dump read twice would drop the file too early.
        with timer("pack"), _FileSystemSharing():
            bodies = [{"serialized_named_tensors": [serialize_named_tensors(named) for _ in range(self.engine_tp_size)],
                       "load_format": None, "flush_cache": False, "weight_version": version} for _ in urls]
        with timer("transfer"):
            await post_all(client, urls, "/update_weights_from_tensor", bodies, phase="update", state=state)
        del flats  # the engines have copied the bucket
        result.buckets += 1
        result.tensors += len(bucket)
        result.bytes += sum(nbytes(t) for _, t in bucket)

    async def close(self, client: EngineClient) -> None:
        return None
