"""The ranks of a tensor-parallel built-in engine: one process each, rank 0 leading, the others following.

Rank 0 is the engine process itself (HTTP server, scheduler, sampling). `TensorParallel.lead` starts ranks
1 .. N-1 as child processes (`python -m slime.engines.builtin.tp_worker`, tp_worker.py) and forms two process groups
of their own (a TCPStore at rank 0 on a free port; never torch's default group, so an engine in a process that
also trains, or a test process, disturbs nothing):

* `control` (gloo, host memory): rank 0 *announces* each model operation it is about to run (`announce`: a pickled
  `(op, args)` of host values: prompts, positions, slot moves, weight names), and the followers run the same
  operation (tp_worker.py). A few operations also collect one answer from every follower (`call`).
* `data` (NCCL on CUDA, gloo on the CPU): the tensors: each decode step's fed tokens (`broadcast` from rank 0: they
  stay on the device, so the overlapped schedule never waits for them on the host), the all-reduces inside the
  forward (tp_shard.py), and the full tensors of a weight update.

Every rank runs the same collectives in the same order because every rank runs the same operations in the same
order: rank 0 announces on its model thread, the only thread that touches the model. Each rank's own device is
`cuda:(i + r)` for an engine on `cuda:i` (`rank_device`).

A follower that exits on its own (crash, OOM kill) leaves rank 0 waiting in a collective that may never end (NCCL)
or fails it (gloo): a watchdog thread of rank 0 sees the exit and calls `on_worker_exit` (the server process exits:
a half-engine answers nothing right). A follower ignores SIGTERM and SIGINT, which reach the whole process group of a
stopped server: it leaves when rank 0 announces `stop` at shutdown, or on its own when rank 0's process is gone.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slime.errors import ConfigError, EngineError, EngineStartError
from slime.net import find_free_port

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096  # one control message: 8 bytes of length, then the pickle when it fits (a decode step's does)
REPLY_BYTES = 65536  # one follower's answer to a `call`
START_TIMEOUT_S = 300.0  # followers joining (Python, torch and transformers imports on a loaded machine)


def rank_device(device: torch.device, rank: int, world: int) -> torch.device:
    """Rank `rank`'s device for an engine on `device` (rank 0's): `cuda:(i + rank)`, or the CPU for every rank.
    ConfigError when the ranks need more GPUs than this process sees."""
    if device.type != "cuda":
        return device
    index = device.index or 0
    if index + world > torch.cuda.device_count():
        raise ConfigError(f"--tp-size {world} on cuda:{index} needs GPUs cuda:{index} .. cuda:{index + world - 1}; "
                          f"this process sees {torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", index + rank)


def _groups(store: dist.Store, rank: int, world: int, device: torch.device,
            timeout: dt.timedelta) -> tuple[Any, Any]:
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        with torch.cuda.device(device):
            data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, world, options)
            # NCCL makes its communicator at a group's first collective: make it here, every rank at once on its own
            # device, rather than at whatever first needs it (a prefill on the model thread, or the warm-up of a
            # decode graph's capture on a side stream), so that a broken NCCL set-up fails the engine's start
            # instead of hanging its first request
            probe = torch.ones(1, device=device)
            data.allreduce([probe]).wait()
            torch.cuda.synchronize(device)
            if int(probe.item()) != world:
                raise EngineStartError(f"tensor parallel: the NCCL all-reduce of rank {rank} gave {probe.item()}, "
                                       f"expected {world}")
    else:
        data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, world, timeout)
    return control, data


class TensorParallel:
    """One rank's handle on the engine's ranks: collectives over `data`, operations announced over `control`."""

    def __init__(self, rank: int, world: int, device: torch.device, store: dist.Store, control: Any, data: Any,
                 master_port: int, workers: list[subprocess.Popen] | None = None) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.store, self.control, self.data = store, control, data
        self.master_port = master_port
        self.workers = workers or []
        self.on_worker_exit: Callable[[int, int], None] = lambda rank, code: None  # the server exits
        self._stopping = False
        self._watchdog: threading.Thread | None = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ start

    @classmethod
    def lead(cls, world: int, device: torch.device, worker_args: Callable[[int], dict[str, Any]],
             timeout_s: float = 600.0, start_timeout_s: float = START_TIMEOUT_S) -> TensorParallel:
        """Start ranks 1 .. world-1 (`worker_args(rank)`: the `EngineArgs` fields that rank runs with) and form the
        groups as rank 0. EngineStartError naming the rank if one exits or does not join in `start_timeout_s`."""
        port = find_free_port("127.0.0.1")
        timeout = dt.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timeout, wait_for_workers=False)
        workers: list[subprocess.Popen] = []
        try:
            for rank in range(1, world):
                cmd = [sys.executable, "-m", "slime.engines.builtin.tp_worker", "--rank", str(rank),
                       "--world-size", str(world), "--master-port", str(port),
                       "--engine-args", json.dumps(worker_args(rank))]
                workers.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + start_timeout_s
            for rank, worker in enumerate(workers, start=1):
                while not store.check([f"joined/{rank}"]):
                    if worker.poll() is not None:
                        raise EngineStartError(f"tensor-parallel rank {rank} (pid {worker.pid}) exited with code "
                                               f"{worker.returncode} before joining (its output is in this log)")
                    if time.monotonic() > deadline:
                        raise EngineStartError(f"tensor-parallel rank {rank} (pid {worker.pid}) did not join in "
                                               f"{start_timeout_s:.0f} s")
                    time.sleep(0.05)
            control, data = _groups(store, 0, world, device, timeout)
        except BaseException:
            for worker in workers:
                worker.kill()
                worker.wait()
            raise
        tp = cls(0, world, device, store, control, data, port, workers)
        logger.info("tensor parallel: %d ranks (followers: pids %s), %s, store port %d", world,
                    [w.pid for w in workers], "NCCL" if device.type == "cuda" else "gloo", port)
        return tp

    @classmethod
    def join(cls, rank: int, world: int, master_port: int, device: torch.device,
             timeout_s: float = 600.0) -> TensorParallel:
        """Join rank 0's groups as follower `rank` (tp_worker.py)."""
        timeout = dt.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", master_port, world, is_master=False, timeout=timeout)
        store.set(f"joined/{rank}", "1")
        control, data = _groups(store, rank, world, device, timeout)
        return cls(rank, world, device, store, control, data, master_port)

    def watch(self) -> None:
        """Rank 0: call `on_worker_exit(rank, code)` from a daemon thread if a follower exits unasked."""
        def run() -> None:
            while not self._stopping:
                for rank, worker in enumerate(self.workers, start=1):
                    if worker.poll() is not None and not self._stopping:
                        logger.error("tensor-parallel rank %d (pid %d) exited with code %s: the engine cannot "
                                     "run its model any more", rank, worker.pid, worker.returncode)
                        self.on_worker_exit(rank, worker.returncode)
                        return
                time.sleep(0.5)

        self._watchdog = threading.Thread(target=run, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------ control

    def announce(self, op: str, *args: Any) -> None:
        """Rank 0: tell the followers to run `op(*args)` next (host values only). A no-op on a follower, so the code
        both run (the slot decoder) announces unconditionally."""
        if not self.leader:
            return
        payload = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        inline = min(len(payload), HEADER_BYTES - 8)
        header[8:8 + inline] = torch.frombuffer(bytearray(payload[:inline]), dtype=torch.uint8)
        self.control.broadcast([header], dist.BroadcastOptions()).wait()
        if len(payload) > inline:
            rest = torch.frombuffer(bytearray(payload[inline:]), dtype=torch.uint8)
            self.control.broadcast([rest], dist.BroadcastOptions()).wait()

    def receive(self) -> tuple[str, tuple]:
        """A follower: the next operation rank 0 announced (blocks until there is one)."""
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        self.control.broadcast([header], dist.BroadcastOptions()).wait()
        length = int(header[:8].view(torch.int64).item())
        inline = min(length, HEADER_BYTES - 8)
        payload = header[8:8 + inline].numpy().tobytes()
        if length > inline:
            rest = torch.zeros(length - inline, dtype=torch.uint8)
            self.control.broadcast([rest], dist.BroadcastOptions()).wait()
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)

    def answer(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable, < REPLY_BYTES), gathered on every rank: a follower answers a `call`."""
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > REPLY_BYTES - 8:
            payload = pickle.dumps(("error", f"answer of {len(payload)} bytes is too long"))
        mine = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
        mine[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        mine[8:8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = [torch.zeros(REPLY_BYTES, dtype=torch.uint8) for _ in range(self.world)]
        self.control.allgather([gathered], [mine]).wait()
        out = []
        for buffer in gathered:
            length = int(buffer[:8].view(torch.int64).item())
            out.append(pickle.loads(buffer[8:8 + length].numpy().tobytes()))
        return out

    def gather(self, op: str, *args: Any) -> list[tuple[str, Any]]:
        """Rank 0: run `op` on every follower and collect their answers, rank 1 first: ("ok", value) or
        ("error", message) each."""
        self.announce(op, *args)
        return self.answer(("ok", None))[1:]

    def call(self, op: str, *args: Any) -> list[Any]:
        """`gather`, the values only: EngineError naming the ranks that failed."""
        answers = self.gather(op, *args)
        failed = [f"rank {rank}: {message}" for rank, (status, message) in enumerate(answers, start=1)
                  if status != "ok"]
        if failed:
            raise EngineError(f"tensor-parallel {op} failed on " + "; ".join(failed))
        return [value for _, value in answers]

    # ------------------------------------------------------------------ data

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place (inside the forward: capturable in a CUDA graph with NCCL)."""
        self.data.allreduce([tensor]).wait()

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's `tensor` (contiguous, same shape and dtype everywhere)."""
        self.data.broadcast([tensor], dist.BroadcastOptions()).wait()

    # ------------------------------------------------------------------ stop

    def stop(self, timeout_s: float = 30.0) -> None:
        """Rank 0: tell the followers to leave, wait for them (killed after `timeout_s`), and close the store's port."""
        self._stopping = True
        if any(worker.poll() is None for worker in self.workers):
            try:
                self.announce("stop")
            except Exception as exc:  # a follower already gone: the others are killed below
                logger.warning("tensor parallel: could not announce stop (%s: %s)", type(exc).__name__, exc)
        for rank, worker in enumerate(self.workers, start=1):
            try:
                worker.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank %d (pid %d) did not leave in %.0f s: killed", rank, worker.pid,
                               timeout_s)
                worker.kill()
                worker.wait()
        if self.workers:
            logger.info("tensor parallel: followers left (exit codes %s)", [w.returncode for w in self.workers])
        self.close()

    def close(self) -> None:
        """Drop the groups and the store (rank 0's store frees its port once nothing holds it)."""
        if self.device.type == "cuda" and self.data is not None and hasattr(self.data, "shutdown"):
            try:
                self.data.shutdown()
            except Exception as exc:  # best effort: the process is leaving the group anyway
                logger.debug("NCCL group shutdown: %s", exc)
        self.control = self.data = self.store = None
