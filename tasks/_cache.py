"""Stage caching: what a stage task's Prefect cache key is made of, and where its results are persisted.

Whether a stage is done is decided by the record beside its output (slime/stages/record.py), for the flows and
`slime <stage>` alike; this cache sits on top of it so that Prefect replays a stored task result without
running the task body. The key of a stage task is the hash of

* the config values that define the stage's artifact (slime/stages/definitions.py; evaluate: its own fields),
* every input artifact's content: the manifest hash of a committed artifact, else a fingerprint of the files,
* the output location (`{store}/{run_id}/{stage}/...`: a new run id is a new run),
* the code version: slime's version, the source of the slime stage module and of the task.

Prefect's default policy hashes the run id and every raw input (a pydantic config included), so it
never reuses across runs; `StageCachePolicy` replaces it. A cached result is only reused while the
artifacts it names are intact: if one is gone or fails its checksums, the key moves on to a
successor key (`superseded_key`), so the stage runs again and its new result is stored there.
Results are JSON (URIs, hashes, small metric dicts), never pickles.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext
from prefect.filesystems import RemoteFileSystem
from prefect.results import ResultStore

import slime
from slime.config import Config, stable_hash
from slime.errors import NotCommittedError, StorageError
from slime.stages.record import StageDefinition, artifact_fingerprint, artifact_problems, config_values
from slime.storage.fs import join_uri, normalize_uri

logger = logging.getLogger(__name__)

RESULTS_DIR = ".prefect-results"  # under the run directory; a leading dot can never be a stage name
MAX_SUPERSEDED = 64


def config_fingerprint(config: Config, fields: tuple[str, ...], left_out: tuple[str, ...] = ()) -> str:
    """Hash of the selected config values (slime.stages.record.config_values: `section` or `section.field`)."""
    return stable_hash(config_values(config, fields, left_out))


def code_version(modules: tuple[str, ...]) -> dict[str, str]:
    """slime's version and the sha256 of each named module's source file."""
    version = {"slime": slime.__version__}
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"cache key: module {module!r} not found")
        version[module] = hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()
    return version


def stage_cache_key(config: Config, config_fields: tuple[str, ...], inputs: dict[str, str], output: str,
                    code_modules: tuple[str, ...], task_source: str | None = None, missing_ok: bool = False,
                    left_out: tuple[str, ...] = ()) -> str:
    """The base cache key of one stage run (before any superseded-result hop)."""
    options = config.run.storage_options
    return stable_hash({
        "config": config_fingerprint(config, config_fields, left_out),
        "inputs": {role: [uri, artifact_fingerprint(uri, options, missing_ok)] for role, uri in sorted(inputs.items())},
        "output": output,
        "code": code_version(code_modules),
        "task_source": task_source,
    })


def superseded_key(key: str) -> str:
    """The key a stage's result moves to when the result stored under `key` is no longer valid."""
    return stable_hash({"superseded": key})


def first_valid_key(store: ResultStore, key: str, storage_options: dict[str, Any] | None = None) -> str:
    """`key` if nothing is stored under it or its result is intact; else the first such successor key."""
    for _ in range(MAX_SUPERSEDED):
        if not store.exists(key):
            return key
        try:
            problems = artifact_problems(store.read(key).result, storage_options)
        except Exception as exc:  # an unreadable record is as stale as a broken artifact
            problems = [f"stored result unreadable: {exc}"]
        if not problems:
            return key
        logger.warning("cached result %s is stale (%s); the stage runs again", key[:12], "; ".join(problems[:3]))
        key = superseded_key(key)
    raise StorageError(f"more than {MAX_SUPERSEDED} superseded results for one stage; clear {RESULTS_DIR}")


@dataclass
class StageCachePolicy(CachePolicy):
    """Cache policy of a stage task `fn(config, run_id, inputs, output)` (see the module docstring)."""

    config_fields: tuple[str, ...] = ()
    code_modules: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()

    @classmethod
    def of(cls, definition: StageDefinition, code_modules: tuple[str, ...]) -> StageCachePolicy:
        """The policy keyed on what defines the stage's artifact (slime/stages/definitions.py)."""
        return cls(config_fields=definition.config_fields, code_modules=code_modules, left_out=definition.left_out)

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        config: Config = inputs["config"]
        try:
            base = stage_cache_key(config, self.config_fields, inputs["inputs"], inputs["output"], self.code_modules,
                                   task_source=TASK_SOURCE.compute_key(task_ctx, inputs, flow_parameters),
                                   left_out=self.left_out)
        except NotCommittedError as exc:  # the stage itself fails on it, with its own message
            logger.warning("no cache key (%s): the stage runs and its result is not stored", exc)
            return None
        return first_valid_key(task_ctx.result_store, base, config.run.storage_options)


def result_storage(store: str, storage_options: dict[str, Any] | None = None) -> Path | str:
    """Where stage results are persisted: `{store}/.prefect-results`, `store` being the run's directory
    `{run.store}/{run_id}` (flows/_stage.py), so that everything a run writes lives under it.

    A local store gives a path (Prefect makes a LocalFileSystem of it). A remote store (s3://...)
    gives the slug of a RemoteFileSystem block saved for it (an unsaved block instance is refused by
    Prefect), so a worker on another machine reads the same results. Needs the Prefect API.
    """
    root = normalize_uri(store)
    if "://" not in root:
        return Path(root) / RESULTS_DIR
    name = f"slime-results-{hashlib.sha256(root.encode()).hexdigest()[:12]}"
    RemoteFileSystem(basepath=join_uri(root, RESULTS_DIR), settings=storage_options or {}).save(name, overwrite=True)
    return f"remote-file-system/{name}"
