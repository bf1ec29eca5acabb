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
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

from slime.engines.client import EngineClient
from slime.sync.common import NamedTensors, SyncResult, Timer, buckets, nbytes, post_all


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """The bucket as views into one shareable flat buffer per (device, dtype), and those buffers."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, (_, tensor) in enumerate(bucket):
        groups[(tensor.device, tensor.dtype)].append(i)
    views: list[tuple[str, torch.Tensor] | None] = [None] * len(bucket)
    flats = []
    for (device, dtype), indices in groups.items():
        total = sum(bucket[i][1].numel() for i in indices)
        flat = torch.empty(total, dtype=dtype, device=device)
        if device.type == "cpu":
            flat.share_memory_()  # allocated in shared memory before the copy: the data is copied once
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

    async def send(self, client: EngineClient, urls: list[str], weights: NamedTensors, version: str,
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
            with timer("pack"), _FileSystemSharing():
                named, flats = pack_bucket(bucket)
                payload = serialize_named_tensors(named)
            pending = (payload, flats, bucket)

    async def _post(self, client: EngineClient, urls: list[str], payload: str, flats: list[torch.Tensor],
                    bucket: list[tuple[str, torch.Tensor]], version: str | None, result: SyncResult,
                    timer: Timer, state: str) -> None:
        body = {"serialized_named_tensors": [payload] * self.engine_tp_size, "load_format": None,
                "flush_cache": False, "weight_version": version}
        with timer("transfer"):
            await post_all(client, urls, "/update_weights_from_tensor", body, phase="update", state=state)
        del flats  # the engines have copied the bucket
        result.buckets += 1
        result.tensors += len(bucket)
        result.bytes += sum(nbytes(t) for _, t in bucket)

    async def close(self, client: EngineClient) -> None:
        return None
