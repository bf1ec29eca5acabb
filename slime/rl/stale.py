"""Set aside the outputs of steps a resumed run will redo.

A run killed after its checkpoint at rollout N may already have committed rollout N+1 (and more in
async mode) and evals of weights that were never checkpointed; one killed before its first
checkpoint leaves outputs from rollout 0 on (the rerun starts over, before-train eval included). One
killed between its checkpoint N and the metrics line of step N has that step's eval redone too. The
resumed run regenerates those steps from the checkpoint, and committed shard sets are never overwritten,
so the old ones are moved (not deleted: nothing is lost) to `{run_id}/rl_stale/{timestamp}-{stage}-{name}`.
"""

from __future__ import annotations

import logging
import time

from slime.storage import ArtifactStore
from slime.storage.fs import open_fs

logger = logging.getLogger(__name__)


def _step_of(name: str) -> int | None:
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else None


def set_aside_stale_steps(store: ArtifactStore, run_id: str, start_rollout_id: int, *,
                          redo_start_eval: bool = False) -> list[str]:
    """Move rollout (and dropped-rollout) outputs of ids >= `start_rollout_id`, and evals of weight
    versions > `start_rollout_id` (>= 0 on a start from 0; >= `start_rollout_id` with `redo_start_eval`,
    when the resumed checkpoint's own step is to be finished again), out of the way; the new URIs."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    moved: list[str] = []
    first_eval = start_rollout_id if redo_start_eval or not start_rollout_id else start_rollout_id + 1
    for stage, first in (("rollout", start_rollout_id), ("rollout_dropped", start_rollout_id),
                         ("eval", first_eval)):
        fs, root = open_fs(store.uri(run_id, stage), store.storage_options)
        if not fs.exists(root):
            continue
        for entry in sorted(fs.ls(root, detail=False)):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            step = _step_of(name)
            if step is None or step < first:
                continue
            target = store.uri(run_id, "rl_stale", f"{stamp}-{stage}-{name}")
            _, target_path = open_fs(target, store.storage_options)
            fs.makedirs(target_path.rsplit("/", 1)[0], exist_ok=True)
            fs.mv(entry, target_path, recursive=True)
            moved.append(target)
    if moved:
        logger.info("resume at rollout %d: moved %d outputs of steps to redo under %s", start_rollout_id,
                    len(moved), store.uri(run_id, "rl_stale"))
    return moved
