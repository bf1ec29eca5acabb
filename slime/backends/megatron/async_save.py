"""Background checkpoint writes (slime's and Megatron's `--async-save`), committed once every rank's files are durable.

`checkpoint.save_checkpoint(..., saver=AsyncSaver())` plans the torch_dist save (a collective), copies this
rank's share of the state to host memory, writes the small JSON files (training state, RNG) and returns:
megatron-core's `AsyncCallsQueue` writes the tensors from a forked process (each file fsync'ed) while
training goes on. The checkpoint is committed only after the writers of *every* rank have finished
(`poll`/`wait`, collective calls made at the same points on every rank): megatron's own finalization
(the `.metadata` and `metadata.json` of each torch_dist directory) first, then our manifest, hashed by
rank 0 on a background thread, so the commit does not stall the step either. Until the manifest exists
the directory is not a checkpoint: a crash or SIGKILL mid-write leaves the previous checkpoint as the
newest committed one (`latest_checkpoint`), and the next save of that iteration clears the leftovers.

One save is in flight at a time: a new save first waits for the previous one to commit (saves 20-100
steps apart rarely find one still writing).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from slime.errors import CorruptArtifactError

logger = logging.getLogger(__name__)


class AsyncSaveError(CorruptArtifactError):
    """A background checkpoint write or its commit failed: the checkpoint was not committed."""


@dataclass
class _Pending:
    """A save whose files are being written: its megatron requests' indices and what commits it."""

    path: str
    calls: set[int]
    commit: Callable[[], Any]
    background: bool  # commit on rank 0 only, on a thread (local store); else on every rank, inline
    started: float = field(default_factory=time.monotonic)
    thread: threading.Thread | None = None
    error: BaseException | None = None


class AsyncSaver:
    """The train ranks' queue of background checkpoint writes (one per process; every call is collective)."""

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._queue = AsyncCallsQueue(persistent=False)
        # megatron's writers report through a queue of a spawned manager process (3.2 s to start on the H100
        # host): started now, while the ranks set up, not in the first save's stall. Megatron keeps one queue per
        # process, and a finalize takes whichever result comes first; a save here writes two requests at once
        # (model, optimizer), which could each record the other's files in their metadata (a checkpoint that
        # did not load, seen under load: KeyError for a model tensor). So each request gets its own queue
        # (`own_results_queue`), from this saver's manager.
        self._filesystem_async = filesystem_async
        self._manager = multiprocessing.get_context("spawn").Manager()
        self._writing: list[_Pending] = []
        self._written: set[int] = set()  # megatron call indices finalized (a save's requests may finish apart)
        self._committing: list[_Pending] = []
        self.committed: list[str] = []  # paths, oldest first (rank 0's are the committed ones)
        self._since_wait = False  # a save scheduled since the last wait: the same on every rank

    @contextlib.contextmanager
    def own_results_queue(self) -> Iterator[None]:
        """Around one `dist_checkpointing.save(..., async_sharded_save=True)`: its writers report to a queue of
        their own (megatron's writer asks `_get_write_results_queue` for it while planning the save)."""
        queue = self._manager.Queue()
        original = self._filesystem_async._get_write_results_queue
        self._filesystem_async._get_write_results_queue = lambda: queue
        try:
            yield
        finally:
            self._filesystem_async._get_write_results_queue = original

    @property
    def in_flight(self) -> int:
        return len(self._writing) + len(self._committing)

    def schedule(self, path: str, requests: list[Any], commit: Callable[[], Any], *, background: bool) -> None:
        """Start writing `requests` (megatron `AsyncRequest`s of one checkpoint, in order) in the background;
        `commit` runs once all of them are durable on every rank: with `background`, on rank 0 only, on a
        thread; else on every rank, in the finalizing call (a collective commit such as node staging's)."""
        self.wait()
        calls = {self._queue.schedule_async_request(request) for request in requests if request is not None}
        self._writing.append(_Pending(path=path, calls=calls, commit=commit, background=background))
        self._since_wait = True

    def poll(self) -> list[str]:
        """Finalize what has finished writing on every rank, without waiting (collective)."""
        return self._finalize(blocking=False)

    def wait(self) -> list[str]:
        """Wait until every scheduled save is written and committed (collective); the paths committed."""
        return self._finalize(blocking=True)

    def close(self) -> None:
        """Commit what is in flight, then stop the writers (at the end of training)."""
        try:
            self.wait()
        finally:
            self._queue.close()
            self._manager.shutdown()

    def _finalize(self, blocking: bool) -> list[str]:
        if self._writing:
            self._written.update(self._queue.maybe_finalize_async_calls(blocking=blocking))
            while self._writing and self._writing[0].calls <= self._written:
                pending = self._writing.pop(0)
                self._written -= pending.calls
                self._start_commit(pending)
        return self._reap(blocking)

    def _start_commit(self, pending: _Pending) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if not pending.background:
            pending.commit()  # collective: every rank
            self._committing.append(pending)
            return
        if rank == 0:
            def run() -> None:
                try:
                    pending.commit()
                except BaseException as exc:  # re-raised by the next poll/wait on this rank
                    pending.error = exc

            pending.thread = threading.Thread(target=run, name=f"commit {pending.path}", daemon=True)
            pending.thread.start()
        self._committing.append(pending)

    def _reap(self, blocking: bool) -> list[str]:
        done = []
        for pending in list(self._committing):
            if pending.thread is not None:
                if blocking:
                    pending.thread.join()
                elif pending.thread.is_alive():
                    continue
            self._committing.remove(pending)
            if pending.error is not None:
                raise AsyncSaveError(f"committing {pending.path} failed; the previous checkpoint stays the newest "
                                     f"committed one: {pending.error}") from pending.error
            logger.info("committed checkpoint %s, %.1f s after its save began", pending.path,
                        time.monotonic() - pending.started)
            done.append(pending.path)
        if blocking and self._since_wait:
            self._since_wait = False
            if dist.is_initialized():
                dist.barrier()  # every rank returns knowing rank 0's commit is published
        self.committed.extend(done)
        return done
