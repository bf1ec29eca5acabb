"""What every stage task does around its one slime call: the task decorator, point the config at the
run's locations, prepare the output location, time the phases and describe the result as JSON."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prefect import task

from slime.config import Config
from slime.errors import StorageError
from slime.storage import is_committed, read_manifest
from slime.storage.fs import open_fs
from slime.storage.manifest import verify_files
from tasks._cache import StageCachePolicy

logger = logging.getLogger(__name__)


def stage_task(name: str, cache: StageCachePolicy, **options: Any) -> Callable[[Callable], Any]:
    """`@task` of a stage `fn(config, run_id, inputs, output)`: run name `<name>-<run_id>` (unless
    `task_run_name` is given), `cache` as its cache policy, its JSON result persisted so that a re-run
    of the pipeline finds it; `options` are further `@task` arguments (tags, ...)."""
    options.setdefault("task_run_name", f"{name}-{{run_id}}")
    return task(name=name, cache_policy=cache, persist_result=True, result_serializer="json", **options)


def with_fields(config: Config, **dotted: Any) -> Config:
    """A validated copy of `config` with `section__field=value` fields replaced (the original is untouched)."""
    data = config.model_dump(mode="json")
    for key, value in dotted.items():
        section, field = key.split("__")
        data[section][field] = value
    return Config.model_validate(data)


def prepare_output(uri: str, attempt_key: str, storage_options: dict[str, Any] | None = None, *,
                   resumable: bool = False) -> list[str]:
    """Make a stage's output location ready for a run; returns what was moved aside.

    A stage only runs when no intact cached result exists, so anything already at `uri` is one of:
    a failed attempt of this very stage run (same `attempt_key`, recorded in `<uri>.attempt.json`),
    a stale or corrupt artifact, or the output of other inputs or config. A resumable stage (one that
    continues from its newest committed checkpoint under `uri`, like SFT) keeps a same-key attempt's
    checkpoints, newest first down to the first intact one, moving corrupt ones aside. Everything else
    is moved aside whole. Moved means renamed to `<name>.replaced-<UTC time>`, never deleted.
    """
    fs, path = open_fs(uri, storage_options)
    marker = f"{path}.attempt.json"
    same_attempt = fs.exists(marker) and json.loads(fs.cat_file(marker)).get("key") == attempt_key
    moved = []
    if fs.exists(path):
        if resumable and same_attempt:
            for child in sorted(fs.ls(path, detail=False), reverse=True):
                if not is_committed(child, storage_options):
                    continue  # uncommitted leftovers are invisible to readers and overwritten by writers
                if not _problems(child, storage_options):
                    break
                moved.append(move_aside(fs, child))
        else:
            moved.append(move_aside(fs, path))
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(marker, json.dumps({"key": attempt_key}).encode())
    return moved


def _problems(uri: str, storage_options: dict[str, Any] | None) -> list[str]:
    try:
        return verify_files(uri, read_manifest(uri, storage_options), storage_options)
    except StorageError as exc:
        return [str(exc)]


def move_aside(fs: Any, path: str) -> str:
    """Rename `path` to `<path>.replaced-<UTC time>` (nothing is deleted); the new path."""
    aside = f"{path.rstrip('/')}.replaced-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%S%fZ')}"
    fs.mv(path, aside, recursive=True)
    logger.warning("moved %s aside to %s", path, aside)
    return aside


def start_stage(cache: StageCachePolicy, config: Config, inputs: dict[str, str], output: str, *,
                resumable: bool = False) -> Phases:
    """The phase timer of a stage run, its phase "prepare output" done: `prepare_output` for this
    attempt (keyed by `cache.attempt_key`)."""
    phases = Phases()
    with phases.time("prepare output"):
        prepare_output(output, cache.attempt_key(config, inputs, output), config.run.storage_options,
                       resumable=resumable)
    return phases


class Phases:
    """Wall time per named phase, for the stage report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - start, 3)


def stage_result(stage: str, artifacts: dict[str, tuple[str, str]], metrics: dict[str, Any],
                 phases: Phases, **extra: Any) -> dict[str, Any]:
    """The JSON result a stage task returns and Prefect persists: artifact URIs with manifest hashes,
    small metrics and phase times. `artifacts` maps a name to (uri, manifest hash)."""
    return {"stage": stage,
            "artifacts": {name: {"uri": uri, "manifest_hash": digest} for name, (uri, digest) in artifacts.items()},
            "metrics": metrics, "seconds": phases.seconds, **extra}
