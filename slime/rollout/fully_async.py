"""Fully asynchronous generation (`--async-mode fully`): groups are generated all the time, on a thread of
the rollout manager, while the trainer takes finished ones a batch at a time.

    gen = FullyAsyncRollout(args, data_source, batch_groups=32, max_lag=1, stale_policy="drop",
                            partial=True, version=0, next_rollout_id=0)
    gen.start()                          # generation runs on its own thread and event loop
    kept, dropped, metrics = gen.take_batch(0)   # blocks until 32 groups are finished
    gen.pause()                          # abort in-flight requests: partial groups keep their tokens
    ...update the engines' weights to version 1...
    gen.resume(1)                        # partial groups continue under version 1 first, then new prompts
    state = gen.state_dict()             # (paused) everything held, for the checkpoint
    gen.stop()

Staleness is bounded twice (slime.rollout.staleness has the version arithmetic):
* admission: a new group is drawn only while the groups held (finished, in flight, interrupted) fit in
  the batches the bound still allows at the engines' version `e`: `(e + K + 1 - next_rollout_id) x batch`
  (K = `max_policy_version_lag`, or 1 for the window when unset), so generation runs at most K batches
  ahead (AReaL's admission control);
* at hand-over: a group whose oldest token is more than K versions behind the batch's trainer version
  (a slow group overtaken by faster ones) is dropped or regenerated from its prompt
  (`stale_policy`), counted in the metrics; the finished groups are handed out oldest first.
A group interrupted by a pause continues with its tokens under the new weights when `partial` (slime's
`--partial-rollout`; each token keeps its version), else it starts again from its prompt.
The engines are the router's workers, listed again at every resume and before every abort of a pause, so
an engine that fault tolerance restarted on a new port is aborted with the others once it is registered.

Every group drawn is, at any time, in exactly one place: a taken batch, the dropped list of a batch
(filtered, failed, stale), or held here (`state_dict`, dropped ones not yet written included), so a checkpoint taken while paused together
with the data source's cursor accounts for every prompt (the resume promise, docs/rl.md).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import Counter
from typing import Any

from slime.errors import ConfigError, DataFormatError
from slime.rollout.filters import call_dynamic_filter, should_drop
from slime.rollout.generate import sampling_params_from_args
from slime.rollout.hooks import check_rollout_plugins
from slime.rollout.http import close_engine_client, engine_client, router_url, worker_urls
from slime.rollout.outputs import flatten
from slime.rollout.rollout import _sort_key, rollout_metrics
from slime.rollout.staleness import group_oldest_version, is_stale
from slime.rollout.state import GenerateState, RolloutEngineError, cancel, drain, first_error_of, group_state
from slime.types import Sample

logger = logging.getLogger(__name__)

STATE_VERSION = 1
PAUSE_TIMEOUT_S = 120.0
DEFAULT_WINDOW_LAG = 1  # batches generation may run ahead when no bound is set


class FullyAsyncRollout:
    """Continuous generation for the RL loop; see the module docstring. Thread-safe: `take_batch`,
    `pause`, `resume`, `state_dict` and `stop` are called from the rollout manager's thread."""

    def __init__(self, args: Any, data_source: Any, *, batch_groups: int, max_lag: int | None,
                 stale_policy: str = "drop", partial: bool = True, version: int = 0,
                 next_rollout_id: int = 0) -> None:
        if batch_groups < 1:
            raise ConfigError(f"fully async rollout needs rollout_batch_size >= 1, got {batch_groups}")
        if stale_policy not in ("drop", "regenerate"):
            raise ConfigError(f"stale_sample_policy must be drop or regenerate, got {stale_policy!r}")
        self.args = args
        self.data_source = data_source
        self.batch_groups = batch_groups
        self.max_lag = max_lag
        self.stale_policy = stale_policy
        self.partial = partial
        self.engine_version = version
        self.next_rollout_id = next_rollout_id
        self._cond = threading.Condition()  # guards every field below; take_batch waits on it
        self._completed: list[list[Sample]] = []  # finished and kept, waiting for a batch
        self._interrupted: list[list[Sample]] = []  # cut by a pause (or to regenerate): admitted first
        self._pristine: dict[int, list[dict[str, Any]]] = {}  # group_index -> the group as drawn
        self._inflight = 0
        self._dropped: list[list[Sample]] = []  # since the last batch
        self._counts: Counter = Counter()
        self._reasons: Counter = Counter()
        self._tokens = 0  # response tokens generated since the last batch
        self._counted = 0  # of the running GenerateState's new_tokens, already in _tokens
        self._pauses = 0  # since the last batch (weight syncs and checkpoints; never an eval on the eval fleet)
        self._failed_in_a_row = 0
        self._first_error = ""
        self._error: BaseException | None = None
        self._idle_s = 0.0
        self._idle_since: float | None = time.monotonic()
        self._last_batch = time.monotonic()
        self._stopping = False
        self._pause_requested = True  # starts paused: `start` then `resume`
        self._paused = threading.Event()
        self._paused.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None
        self._resumed: asyncio.Event | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Start the generation thread and let it generate at the current engine version."""
        if self._thread is not None:
            raise RuntimeError("FullyAsyncRollout.start called twice")
        ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,), name="fully-async-rollout",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        self.resume(self.engine_version)

    def stop(self) -> None:
        """Abort what is in flight and end the thread (idempotent). What is held stays in `state_dict`."""
        if self._thread is None:
            return
        self._stopping = True
        try:
            self.pause()
        except Exception as exc:  # noqa: BLE001 - stopping: report, go on
            logger.warning("fully async rollout: stopping after an error: %s", exc)
        self._signal(self._resumed)
        self._thread.join(timeout=PAUSE_TIMEOUT_S)
        self._thread = None

    def pause(self) -> dict[str, float]:
        """Abort every in-flight request and wait until generation has stopped (before a weight update
        or a checkpoint); interrupted groups are held. Returns the time it took."""
        t0 = time.monotonic()
        with self._cond:
            self._pause_requested = True
            self._pauses += 1
        self._signal(self._wake)
        if not self._paused.wait(PAUSE_TIMEOUT_S):
            raise RolloutEngineError(f"fully async rollout did not stop within {PAUSE_TIMEOUT_S:.0f} s of a pause")
        self._raise_error()
        return {"perf/pause_generation_s": time.monotonic() - t0}

    def resume(self, version: int) -> None:
        """Generate again, at engine weight `version`: interrupted groups first (those already past the
        bound for any later batch are dropped or regenerated now), then new prompts."""
        self._raise_error()
        with self._cond:
            self.engine_version = version
            fresh, again = self._sift(self._interrupted, self.next_rollout_id)
            self._interrupted = fresh + again
            self._pause_requested = False
            self._paused.clear()
        self._signal(self._resumed)

    def _signal(self, event: asyncio.Event | None) -> None:
        if self._loop is not None and event is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(event.set)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ the trainer's side

    def take_batch(self, rollout_id: int, timeout: float | None = None) -> tuple[list[list[Sample]],
                                                                               list[list[Sample]], dict[str, Any]]:
        """Block until `batch_groups` finished groups within the bound exist; (kept groups, groups dropped
        since the last batch, the step's metrics). `rollout_id` must be the next batch's id."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if rollout_id != self.next_rollout_id:
                raise ValueError(f"take_batch({rollout_id}): the next batch is {self.next_rollout_id}")
            while True:
                self._raise_error()
                self._enforce_bound(rollout_id)
                if len(self._completed) >= self.batch_groups:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"batch {rollout_id}: {len(self._completed)} of {self.batch_groups} groups "
                                       f"finished after {timeout:.0f} s")
                self._cond.wait(timeout=1.0)
            self._completed.sort(key=lambda g: (_oldest(g), _sort_key(g)))  # oldest first: least stale later
            kept = sorted(self._completed[:self.batch_groups], key=_sort_key)
            del self._completed[:self.batch_groups]
            dropped, self._dropped = self._dropped, []
            for group in kept + dropped:
                self._pristine.pop(_group_index(group), None)
            counts, self._counts = self._counts, Counter()
            reasons, self._reasons = self._reasons, Counter()
            tokens, self._tokens = self._tokens, 0
            pauses, self._pauses = self._pauses, 0
            now = time.monotonic()
            idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
            self._idle_s, self._idle_since = 0.0, (now if self._idle_since is not None else None)
            elapsed, self._last_batch = now - self._last_batch, now
            self.next_rollout_id += 1
            counts["kept"] = len(kept)
            held = self._held()
        self._signal(self._wake)
        metrics = rollout_metrics(self.args, kept, counts, reasons, elapsed, tokens, trainer_version=rollout_id)
        metrics.update({"async/groups/held": held, "async/groups/stale_dropped": counts["stale_dropped"],
                        "async/groups/stale_regenerated": counts["stale_regenerated"],
                        "async/groups/interrupted": counts["interrupted"],
                        "async/groups/restarted": counts["restarted"], "async/engine_version": self.engine_version,
                        "async/generation_pauses": pauses,
                        "perf/engine_idle_s": idle})
        return kept, dropped, metrics

    def _enforce_bound(self, trainer_version: int) -> None:
        """Drop or regenerate finished groups that are too stale for `trainer_version` (lock held)."""
        if self.max_lag is None:
            return
        fresh, again = self._sift(self._completed, trainer_version)
        if len(fresh) != len(self._completed):
            self._completed = fresh
            self._interrupted += again
            self._signal(self._wake)

    def _sift(self, groups: list[list[Sample]], trainer_version: int) -> tuple[list[list[Sample]],
                                                                              list[list[Sample]]]:
        """(groups within the bound at `trainer_version`, stale ones restarted from their prompts to generate
        again); the stale policy is applied to the others: dropped ones go to the dropped list (lock held)."""
        fresh, again = [], []
        for group in groups:
            if not is_stale(flatten(group), trainer_version, self.max_lag):
                fresh.append(group)
            elif self.stale_policy == "drop":
                self._counts["stale_dropped"] += 1
                for s in flatten(group):
                    s.metadata["dropped_reason"] = "stale"
                self._dropped.append(group)
            else:
                self._counts["stale_regenerated"] += 1
                again.append(self._restart(group))
        return fresh, again

    def _restart(self, group: list[Sample]) -> list[Sample]:
        """The group as it was drawn (its prompt, ids and metadata; no tokens)."""
        return [Sample.from_dict(copy.deepcopy(d)) for d in self._pristine[_group_index(group)]]

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Everything held (finished, interrupted, their prompts as drawn, dropped since the last batch) and
        the data source's cursor, as JSON; only while paused, so that nothing is half-way."""
        if not self._paused.is_set():
            raise RuntimeError("FullyAsyncRollout.state_dict needs generation paused (call pause first)")
        with self._cond:
            return {"version": STATE_VERSION, "next_rollout_id": self.next_rollout_id,
                    "data_source": self.data_source.state_dict(),
                    "completed": [[s.to_dict() for s in g] for g in self._completed],
                    "interrupted": [[s.to_dict() for s in g] for g in self._interrupted],
                    "dropped": [[s.to_dict() for s in g] for g in self._dropped],
                    "pristine": {str(k): copy.deepcopy(v) for k, v in self._pristine.items()}}

    def load_state_dict(self, state: dict[str, Any], where: str = "fully async state") -> None:
        """Restore `state_dict()` before `start` (a malformed state changes nothing). Without its
        "data_source" entry the data source is left as it is: the RL loop keeps that state once, at the
        checkpoint's top level, and restores it before generation starts."""
        if self._thread is not None:
            raise RuntimeError("FullyAsyncRollout.load_state_dict must come before start")
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataFormatError(f"{where}: expected a fully async state of version {STATE_VERSION}")
        try:
            completed = [[Sample.from_dict(s) for s in g] for g in state["completed"]]
            interrupted = [[Sample.from_dict(s) for s in g] for g in state["interrupted"]]
            dropped = [[Sample.from_dict(s) for s in g] for g in state["dropped"]]
            pristine = {int(k): list(v) for k, v in state["pristine"].items()}
            next_id = int(state["next_rollout_id"])
        except (KeyError, TypeError, ValueError, DataFormatError) as exc:
            raise DataFormatError(f"{where}: {type(exc).__name__}: {exc}") from None
        missing = [_group_index(g) for g in completed + interrupted if _group_index(g) not in pristine]
        if missing:
            raise DataFormatError(f"{where}: groups {missing[:5]} have no prompt as drawn (field 'pristine')")
        if next_id != self.next_rollout_id:
            raise DataFormatError(f"{where}: saved before batch {next_id}, resuming at batch {self.next_rollout_id}")
        if "data_source" in state:
            self.data_source.load_state_dict(state["data_source"], where=f"{where}: data_source")
        self._completed, self._interrupted, self._pristine = completed, interrupted, pristine
        self._dropped = dropped  # written with the next batch, under rollout_dropped/

    # ------------------------------------------------------------------ the generation thread

    def _thread_main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._wake, self._resumed = asyncio.Event(), asyncio.Event()
        ready.set()
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's side
            logger.exception("fully async rollout stopped on an error")
            with self._cond:
                self._error = exc if isinstance(exc, Exception) else RolloutEngineError(repr(exc))
                self._cond.notify_all()
        finally:
            with self._cond:
                self._pause_requested = True
            self._paused.set()
            loop.run_until_complete(close_engine_client())
            loop.close()

    async def _main(self) -> None:
        args = self.args
        plugins = check_rollout_plugins(args)
        url = router_url(args)

        async def listed() -> list[str]:
            """The router's workers now: fault tolerance replaces a dead engine by one on a new port, which
            is registered when it holds the current weights (at once, or by the next weight update)."""
            return await worker_urls(engine_client(), url)

        params = sampling_params_from_args(args)
        assert self._wake is not None and self._resumed is not None
        while True:
            await self._resumed.wait()
            self._resumed.clear()
            if self._stopping:
                return
            urls = await listed()  # each round: an engine registered by the last weight update is in it
            if not urls:
                raise RolloutEngineError(f"router {url} has no worker registered")
            state = GenerateState(args, plugins, len(urls), rollout_id=self.next_rollout_id)
            self._counted = 0
            pending: set[asyncio.Task] = set()
            try:
                while not self._pause_requested:
                    self._wake.clear()
                    for group in self._admit():
                        pending.add(asyncio.create_task(state.generate_group(group, params)))
                    with self._cond:
                        self._mark_idle(not pending)
                        self._count_tokens(state)
                    waiter = asyncio.create_task(self._wake.wait())
                    done, _ = await asyncio.wait(pending | {waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    for task in done - {waiter}:
                        pending.discard(task)
                        self._finish(task.result(), plugins)
                for group in await drain(state, pending, urls, refresh=listed) if pending else []:
                    self._finish(group, plugins)
            except BaseException:
                if pending:
                    await cancel(state, pending, urls)
                raise
            with self._cond:
                self._count_tokens(state)
                self._mark_idle(True)
                self._cond.notify_all()
            self._paused.set()

    def held(self) -> int:
        """Groups held now: finished and not yet taken, in flight, or interrupted."""
        with self._cond:
            return self._held()

    def _held(self) -> int:  # the lock taken
        return len(self._completed) + self._inflight + len(self._interrupted)

    def _admit(self) -> list[list[Sample]]:
        """Groups to start now: interrupted ones first, then new prompts, within the window."""
        with self._cond:
            lag = self.max_lag if self.max_lag is not None else DEFAULT_WINDOW_LAG
            allowed = (self.engine_version + lag + 1 - self.next_rollout_id) * self.batch_groups
            room = allowed - self._held()
            groups, self._interrupted = self._interrupted, []
            if room > 0:
                fresh = self.data_source.get_samples(room, self.next_rollout_id)
                for group in fresh:
                    self._pristine[_group_index(group)] = [copy.deepcopy(s.to_dict()) for s in group]
                self._counts["drawn"] += len(fresh)
                groups += fresh
            self._inflight += len(groups)
            return groups

    def _finish(self, group: list[Any], plugins: Any) -> None:
        """Sort one returned group: failed, interrupted, filtered out, or finished (lock taken here)."""
        with self._cond:
            self._inflight -= 1
            kind = group_state(group)
            if kind == "failed":
                self._counts["failed"] += 1
                self._counts["failed_samples"] += len(flatten(group))
                self._dropped.append(group)
                self._failed_in_a_row += 1
                self._first_error = self._first_error or first_error_of(group)
                if self._failed_in_a_row >= self.batch_groups:
                    raise RolloutEngineError(f"{self._failed_in_a_row} groups in a row failed; first error: "
                                             f"{self._first_error}")
                return
            if kind == "aborted":
                self._counts["interrupted"] += 1
                if not self.partial:
                    self._counts["restarted"] += 1
                    group = self._restart(group)
                self._interrupted.append(group)
                return
            self._failed_in_a_row = 0
            decision = call_dynamic_filter(plugins.dynamic_filter, self.args, group)
            live = len(self._completed) + self._inflight + 1
            if should_drop(decision, groups_live=live, target=self.batch_groups):
                self._counts["filtered"] += 1
                self._reasons[decision.reason or "unspecified"] += 1
                self._dropped.append(group)
                return
            self._completed.append(group)
            self._cond.notify_all()

    def _count_tokens(self, state: GenerateState) -> None:
        """Add what `state` generated since the last count to the batch's tokens (lock held)."""
        self._tokens += state.new_tokens - self._counted
        self._counted = state.new_tokens

    def _mark_idle(self, idle: bool) -> None:
        """Engine idle time: nothing in flight (paused, or the window is full)."""
        now = time.monotonic()
        if idle and self._idle_since is None:
            self._idle_since = now
        elif not idle and self._idle_since is not None:
            self._idle_s += now - self._idle_since
            self._idle_since = None


def _group_index(group: list[Any]) -> int:
    return flatten(group)[0].group_index


def _oldest(group: list[Any]) -> int:
    """Sort key: the group's oldest token version (groups without one last)."""
    oldest = group_oldest_version(flatten(group))
    return 1 << 62 if oldest is None else oldest
