"""slime's train-side profiling: torch.profiler traces and allocator memory snapshots of a train rank.

What is covered follows slime's flags (`slime/observability/profile_utils.py`):

* `megatron.use_pytorch_profiler` (Megatron's flag) with `run.profile_target`: `train_overall` profiles the
  rank across rollouts (one profiler step per rollout), `train_actor` the optimizer steps of each rollout,
  `train_log_probs` the micro-batches of each log-prob pass. The schedule is Megatron's
  `profile_step_start`/`profile_step_end` (defaults 10 and 12), counted in those steps. Traces go to
  `run.tensorboard_dir` as slime's do (`memory_snapshot_dir` when it is unset), one gzipped Chrome trace
  per target and rank (`{target}_rank_{rank}`), readable by TensorBoard and Perfetto.
* `run.record_memory_history` (with `train_overall`): from the rank's start, `memory_recorder` torch records
  the CUDA caching allocator's history (`torch.cuda.memory._record_memory_history`) and dumps it after
  `memory_snapshot_num_steps` rollouts, and on an out-of-memory error; memray runs a `memray.Tracker`
  over the same span. Snapshots go to `memory_snapshot_dir`.

Departure: torch's snapshot is written as JSON (`torch.cuda.memory._snapshot()`), not pickled as
slime's is: nothing here is stored as a pickle. The torch recorder needs CUDA (the allocator it records
is CUDA's): on a machine without it, asking for it is a `ConfigError` rather than a silent no-op.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from slime.errors import ConfigError

logger = logging.getLogger(__name__)

TARGETS = ("train_overall", "train_actor", "train_log_probs")


class TrainProfiler:
    """The profilers one train rank runs, from its config (`slime.config.Config`)."""

    def __init__(self, config: Any, rank: int) -> None:
        run, megatron = config.run, config.megatron
        self.rank = rank
        self.targets = set(run.profile_target)
        self.use_torch = bool(megatron.get("use_pytorch_profiler", False))
        self.start = int(megatron.get("profile_step_start", 10))
        self.end = int(megatron.get("profile_step_end", 12))
        if self.use_torch and "train_overall" in self.targets and len(self.targets) > 1:
            raise ConfigError(f"run.profile_target {sorted(self.targets)}: torch.profiler runs one profiler at a "
                              "time, and train_overall spans the others: profile train_overall alone, or "
                              "train_actor and/or train_log_probs")
        if self.use_torch and self.end <= self.start:
            raise ConfigError(f"megatron.profile_step_end ({self.end}) must be above profile_step_start "
                              f"({self.start}): the profiler records steps start .. end - 1")
        self.trace_dir = run.tensorboard_dir or run.memory_snapshot_dir
        self.snapshot_steps = run.memory_snapshot_num_steps
        self._overall = self._torch_profiler("train_overall") if self.use_torch and "train_overall" in \
            self.targets else None
        self._memory: _MemoryRecorder | None = None
        if run.record_memory_history and "train_overall" in self.targets:
            self._memory = _MemoryRecorder(run.memory_recorder, Path(run.memory_snapshot_dir), rank,
                                           self.snapshot_steps)
            self._memory.start()

    def on_init_end(self) -> None:
        """The rank is built and loaded: the overall profiler starts counting rollouts."""
        if self._overall is not None:
            self._overall.start()

    def step(self, rollout_id: int) -> None:
        """One rollout trained: a profiler step; the memory snapshot after `memory_snapshot_num_steps`."""
        if self._overall is not None:
            self._overall.step()
        if self._memory is not None and self.snapshot_steps is not None and rollout_id == self.snapshot_steps - 1:
            self._memory.stop()

    def iterate(self, target: str, items: Iterable[Any]) -> Iterator[Any]:
        """`items`, with a profiler step after each when `target` is profiled (a fresh profiler per call)."""
        if not (self.use_torch and target in self.targets):
            yield from items
            return
        profiler = self._torch_profiler(target)
        profiler.start()
        try:
            for item in items:
                yield item
                profiler.step()
        finally:
            profiler.stop()

    def close(self) -> None:
        """Stop what is still recording (writes the overall trace when its window is open)."""
        if self._overall is not None:
            self._overall.stop()
            self._overall = None
        if self._memory is not None:
            self._memory.stop()

    def _torch_profiler(self, target: str) -> torch.profiler.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        Path(self.trace_dir).mkdir(parents=True, exist_ok=True)
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=max(self.start - 1, 0), warmup=1 if self.start > 0 else 0,
                                             active=self.end - self.start, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir,
                                                                    worker_name=f"{target}_rank_{self.rank}",
                                                                    use_gzip=True),
            record_shapes=True, with_stack=True, profile_memory=True, with_flops=True)


class _MemoryRecorder:
    """Allocator history (torch, CUDA) or a memray tracker, dumped once to `directory`."""

    def __init__(self, recorder: str, directory: Path, rank: int, num_steps: int | None) -> None:
        self.recorder = recorder
        stem = directory / f"memory_snapshot_time{time.time()}_rank{rank}"
        if recorder == "torch":
            if not torch.cuda.is_available():
                raise ConfigError("run.record_memory_history with memory_recorder torch records the CUDA caching "
                                  "allocator, and this train rank has no CUDA device; use memory_recorder memray "
                                  "for host memory")
            self.path = stem.with_suffix(".json")
        else:
            if num_steps is None:
                raise ConfigError("run.memory_recorder memray needs run.memory_snapshot_num_steps (when to stop)")
            try:
                import memray  # noqa: F401
            except ImportError:
                raise ConfigError("run.memory_recorder memray needs the memray package (pip install memray)") from None
            self.path = stem.with_suffix(".bin")
        directory.mkdir(parents=True, exist_ok=True)
        self._active = False
        self._tracker: Any = None

    def start(self) -> None:
        if self.recorder == "torch":
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="all")
            attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
            if attach is not None:
                attach(self._on_oom)
        else:
            import memray

            self._tracker = memray.Tracker(file_name=str(self.path), native_traces=True)
            self._tracker.__enter__()
        self._active = True
        logger.info("recording memory (%s) into %s", self.recorder, self.path)

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        logger.error("out of memory on device %d (asked %d bytes, %d free): dumping the memory history to %s",
                     device, alloc, device_free, self.path)
        self._dump()

    def _dump(self) -> None:
        self.path.write_text(json.dumps(torch.cuda.memory._snapshot(), default=str))

    def stop(self) -> None:
        if not self._active:
            return
        self._active = False
        if self.recorder == "torch":
            self._dump()
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            self._tracker.__exit__(None, None, None)
        logger.info("memory snapshot written to %s", self.path)
