"""Rollout and eval outputs in the artifact store (written only when `args.run_id` is set).

Layout under `{store}/{run_id}/`:

    rollout/{rollout_id:06d}/              the kept groups of a step (what the trainer reads)
    rollout_dropped/{rollout_id:06d}/      filtered, failed and dropped-after-abort samples, for audit
    eval/{rollout_id:06d}-{dataset}/       every eval sample of one dataset
    eval/{rollout_id:06d}-summary/summary.json   the eval report of every dataset

Each is committed with its manifest (written last); the step's metrics ride in the manifest metadata.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from slime.errors import AlreadyCommittedError
from slime.rollout.outputs import flatten
from slime.storage import ArtifactStore, commit_directory, is_committed
from slime.storage.fs import join_uri, open_fs
from slime.types import Sample

logger = logging.getLogger(__name__)


def _store(args: Any) -> ArtifactStore | None:
    if not getattr(args, "run_id", None):
        return None
    return ArtifactStore(getattr(args, "store", None) or "./runs", getattr(args, "storage_options", None) or {})


def check_not_written(args: Any, stage: str, name: str) -> None:
    """Raise AlreadyCommittedError at set-up if the step's output exists (re-running a committed step
    would otherwise generate a whole step and then fail to write it)."""
    store = _store(args)
    if store is not None:
        uri = store.uri(args.run_id, stage, name)
        if is_committed(uri, store.storage_options):
            raise AlreadyCommittedError(f"{uri} is already committed: rollout/eval step {name} of run "
                                        f"{args.run_id!r} was written before; use a new rollout_id or run_id")


def _write(store: ArtifactStore, run_id: str, stage: str, name: str, samples: list[Sample],
           metadata: dict[str, Any]) -> str:
    with store.shard_writer(run_id, stage, name, metadata=metadata) as writer:
        writer.write(samples)
    return writer.uri


def write_rollout(args: Any, rollout_id: int, kept: list[Any], dropped: list[Any],
                  metrics: dict[str, Any]) -> str | None:
    """Write a step's kept groups (and its dropped ones, if any); the URI of the kept set, or None
    when no run_id is configured."""
    store = _store(args)
    if store is None:
        logger.info("rollout %s: no run_id, samples not written to the store", rollout_id)
        return None
    name = f"{rollout_id:06d}"
    meta = {"rollout_id": rollout_id, "metrics": metrics}
    uri = _write(store, args.run_id, "rollout", name, flatten(kept), meta)
    if dropped:
        _write(store, args.run_id, "rollout_dropped", name, flatten(dropped), meta)
    return uri


def write_eval(args: Any, rollout_id: int, samples: dict[str, list[Sample]],
               summary: dict[str, Any]) -> str | None:
    """Write one shard set per eval dataset and the summary; the summary's URI (None without run_id)."""
    store = _store(args)
    if store is None:
        return None
    for dataset, data in samples.items():
        _write(store, args.run_id, "eval", f"{rollout_id:06d}-{dataset}", data,
               {"rollout_id": rollout_id, "dataset": dataset, "summary": summary.get(dataset, {})})
    uri = store.uri(args.run_id, "eval", f"{rollout_id:06d}-summary")
    fs, root = open_fs(uri, store.storage_options)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(join_uri(root, "summary.json"), json.dumps(summary, indent=2, sort_keys=True).encode())
    commit_directory(uri, "eval_summary", metadata={"rollout_id": rollout_id},
                     storage_options=store.storage_options)
    return join_uri(uri, "summary.json")
