"""Distributed mode (decoupled engines): the trainer broadcasts buckets over a process group of its own.

The trainer's sending rank is rank 0 of a group with every engine (engine i is rank i + 1; each
engine runs one tensor-parallel rank): a TCPStore at `master_address:port` and a `ProcessGroupGloo`
(CPU) or `ProcessGroupNCCL` (GPU), independent of the trainer's default group. It is joined once
through `/init_weights_update_group` (posted to every engine while the trainer joins too: the group
forms only when all ranks are there) and reused by later syncs while the engine set is unchanged.
Per bucket the trainer posts `/update_weights_from_distributed` (names, dtypes, shapes) to all engines
and, concurrently, broadcasts the tensors one by one in that order. A failed sync drops the group
(the engines are asked to destroy theirs), so the next sync forms a new one. With a `DeltaFilter`
(`--update-weight-mode delta`) only the changed tensors are announced and broadcast, with their checksums
(distributed_delta.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

import torch
import torch.distributed as dist

from slime.engines.builtin.weights import on_device  # the group's daemon threads start on cuda:0
from slime.engines.client import EngineClient
from slime.net import find_free_port
from slime.sync.common import (
    NamedTensors,
    SyncResult,
    Timer,
    WeightSyncError,
    buckets,
    in_thread,
    nbytes,
    post_all,
)
from slime.sync.distributed_delta import DeltaFilter

logger = logging.getLogger(__name__)

GROUP_NAME = "slime_weight_sync"
SETTLE_S = 30.0  # after an engine failed, how long to let the broadcast to the others finish


def sending_device(backend: str) -> torch.device:
    """Where rank 0's tensors are broadcast from: the caller's current CUDA device, with its index (NCCL),
    else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def trainer_store(address: str, world_size: int, timeout: dt.timedelta) -> dist.TCPStore:
    """Rank 0's TCPStore on `address`, on a port the OS picks as it binds (port 0; `store.port` says which), so no
    other process can take it between choosing and binding (a port probed free and bound later once was taken)."""
    return dist.TCPStore(address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


class _TrainerGroup:
    """Rank 0's side of the group: its store (the TCPStore server), process group and sending device."""

    def __init__(self, store: dist.TCPStore, world_size: int, backend: str, timeout: dt.timedelta,
                 device: torch.device | None = None) -> None:
        self.device = device or sending_device(backend)  # pass the caller's: this may run on a fresh thread
        self.store = store
        prefixed = dist.PrefixStore(GROUP_NAME, self.store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, 0, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            with on_device(self.device):
                self.group = dist.ProcessGroupNCCL(prefixed, 0, world_size, options)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        with on_device(self.device):
            for tensor in tensors:
                self.group.broadcast([tensor], dist.BroadcastOptions()).wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)


class DistributedSync:
    """Buckets of `buffer_size` bytes broadcast from this process (rank 0) to every engine."""

    def __init__(self, buffer_size: int, *, master_address: str = "127.0.0.1", backend: str | None = None,
                 timeout_s: float = 600.0, delta: DeltaFilter | None = None) -> None:
        self.buffer_size = buffer_size
        self.delta = delta  # delta mode: only changed tensors are broadcast (distributed_delta.py)
        self._unverified: set[str] = set()  # engines already logged as not checking the delta's checksums
        self.master_address = master_address
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout = dt.timedelta(seconds=timeout_s)
        self._group: _TrainerGroup | None = None
        self._urls: list[str] = []

    async def send(self, client: EngineClient, urls: list[str], weights: NamedTensors, version: str,
                   result: SyncResult, timer: Timer, state: str) -> None:
        try:
            if self._group is None or self._urls != urls:
                if self.delta is not None:
                    self.delta.reset()  # engines new to this group may hold anything: send everything
                with timer("connect"):
                    await self._connect(client, urls, state)
            named = weights if self.delta is None else self.delta.select(weights, result)
            source = iter(buckets(named, self.buffer_size))
            with timer("export"):
                bucket = next(source, None)
            while bucket is not None:
                with timer("export"):
                    following = next(source, None)
                await self._send_bucket(client, urls, bucket, version if following is None else None, timer, state)
                result.buckets += 1
                result.tensors += len(bucket)
                result.bytes += sum(nbytes(t) for _, t in bucket)
                bucket = following
            if self.delta is not None:
                if result.buckets == 0:  # nothing changed: only the version moves
                    with timer("transfer"):  # SGLang's default aborts running requests: none may be (paused)
                        await post_all(client, urls, "/update_weight_version",
                                       {"new_version": version, "abort_all_requests": False}, phase="update",
                                       state=state)
                self.delta.commit()
        except BaseException:
            if self.delta is not None:
                self.delta.reset()  # the engines may hold part of this sync: the next one is full
            await self.close(client)  # a broken or half-used group is not reused
            raise

    async def _connect(self, client: EngineClient, urls: list[str], state: str) -> None:
        await self.close(client)
        world_size = len(urls) + 1
        try:
            find_free_port(self.master_address)  # binds the address: refuses at once one that is not this host's
            store = await in_thread(lambda: trainer_store(self.master_address, world_size, self.timeout))
        except Exception as error:  # nothing has been asked of the engines yet
            raise WeightSyncError(
                f"this trainer could not open the weight-sync store on {self.master_address}: {type(error).__name__}: "
                f"{error} (the master address must be one of this host's, which the engines can reach)",
                phase="connect", state=state) from error
        port = store.port
        bodies = [{"master_address": self.master_address, "master_port": port, "rank_offset": i + 1,
                   "world_size": world_size, "group_name": GROUP_NAME, "backend": self.backend,
                   "timeout_s": self.timeout.total_seconds()} for i in range(len(urls))]
        device = sending_device(self.backend)  # this thread's device; the group's threads start on cuda:0
        joining = in_thread(lambda: _TrainerGroup(store, world_size, self.backend, self.timeout, device))
        # the engines answer once the group has formed, which needs this rank as well
        posting = asyncio.ensure_future(
            post_all(client, urls, "/init_weights_update_group", bodies, phase="connect", state=state))
        await asyncio.wait([joining, posting], return_when=asyncio.FIRST_COMPLETED)
        if joining.done() and joining.exception() is not None and not posting.done():
            # this rank could not open the group (its process group failed to form, say): the engines would
            # wait for it until the group timeout, so stop waiting now and report why
            posting.cancel()
            await asyncio.wait([posting])
            await self._destroy_on(client, urls)
            error = joining.exception()
            raise WeightSyncError(
                f"this trainer could not open the weight-sync group on {self.master_address}:{port}: "
                f"{type(error).__name__}: {error}", phase="connect", state=state) from error
        try:
            await posting
        except WeightSyncError:
            # The trainer's side waits for the missing ranks until the timeout on its own daemon thread.
            await self._destroy_on(client, urls)
            raise
        self._group = await joining
        self._urls = list(urls)
        logger.info("weight sync group of %d ranks formed (%s, %s:%d)", world_size, self.backend,
                    self.master_address, port)

    async def _send_bucket(self, client: EngineClient, urls: list[str], bucket: list[tuple[str, torch.Tensor]],
                           version: str | None, timer: Timer, state: str) -> None:
        group = self._group
        with timer("pack"):
            tensors = [t.detach().to(group.device).contiguous() for _, t in bucket]
        body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "group_name": GROUP_NAME, "flush_cache": False,
                "weight_version": version}
        if self.delta is not None:
            with timer("checksum"):
                body["checksums"] = await in_thread(lambda: self.delta.checksums(body["names"], tensors))
            body["checksum_algorithm"] = self.delta.algorithm
        with timer("transfer"):
            sending = in_thread(lambda: group.broadcast(tensors))
            try:
                answers = await post_all(client, urls, "/update_weights_from_distributed", body, phase="update",
                                         state=state)
            except WeightSyncError:
                # an engine that refused a tensor still received them all; one that died did not, and
                # the broadcast to it ends with the group's timeout on the daemon thread
                await asyncio.wait([sending], timeout=SETTLE_S)
                if sending.done() and not sending.cancelled():
                    sending.exception()  # retrieved: the HTTP failure is the error reported
                raise
            await sending
        if self.delta is not None:
            self._note_unverified(answers, body["checksum_algorithm"])

    def _note_unverified(self, answers: dict[str, Any], algorithm: str) -> None:
        """Log (once per engine) an engine that applied a delta bucket without checking its checksums:
        SGLang's request struct drops the `checksums` field it does not know."""
        for url, answer in answers.items():
            if url not in self._unverified and not (isinstance(answer, dict) and "checksums_verified" in answer):
                self._unverified.add(url)
                logger.warning("engine %s does not check the delta's %s checksums (an SGLang engine ignores the "
                               "field): its distributed updates are applied unverified", url, algorithm)

    async def _destroy_on(self, client: EngineClient, urls: list[str]) -> None:
        for url in urls:
            try:
                await client.post(url + "/destroy_weights_update_group", {"group_name": GROUP_NAME})
            except Exception as exc:  # an engine that never joined or is gone: nothing to destroy
                logger.debug("destroy_weights_update_group on %s: %s", url, exc)

    async def close(self, client: EngineClient) -> None:
        """Leave the group: the engines destroy their side, this process drops its own."""
        if self._group is not None:
            await self._destroy_on(client, self._urls)
        self._group, self._urls = None, []
