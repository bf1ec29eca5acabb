"""The artifact store's layout: `{root}/{run_id}/{stage}/{name}`.

Every stage reads its inputs from and writes its outputs to this tree, so a stage can be re-run or
resumed alone. The root is any fsspec URL (`./runs` by default, `s3://bucket/prefix`, `memory://x`).
"""

from __future__ import annotations

import re
from typing import Any

from slime.errors import ConfigError
from slime.storage.fs import is_local, join_uri, normalize_uri, open_fs
from slime.storage.manifest import MANIFEST_NAME
from slime.storage.shards import ShardSet, ShardSetWriter

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _check_name(kind: str, value: str) -> str:
    if not _NAME.match(value or ""):
        raise ConfigError(f"{kind} {value!r} must match {_NAME.pattern} (letters, digits, '.', '_', '-')")
    return value


class ArtifactStore:
    """Paths of a run's artifacts and factories for the readers and writers that live there."""

    def __init__(self, root: str = "./runs", storage_options: dict[str, Any] | None = None) -> None:
        self.root = normalize_uri(root)
        self.storage_options = storage_options or {}

    @classmethod
    def from_config(cls, config: Any) -> ArtifactStore:
        """The store named by a `slime.config.Config` (`run.store`, `run.storage_options`)."""
        return cls(config.run.store, config.run.storage_options)

    def uri(self, run_id: str, stage: str | None = None, *parts: str) -> str:
        """`{root}/{run_id}[/{stage}[/parts...]]` with every component checked."""
        components = [_check_name("run_id", run_id)]
        if stage is not None:
            components.append(_check_name("stage", stage))
        components.extend(_check_name("artifact name", p) for p in parts)
        return join_uri(self.root, *components)

    def local_dir(self, run_id: str, stage: str, *parts: str) -> str | None:
        """`{store}/{run_id}/{stage}/...` as a local directory (created), for what child processes write as
        plain files (engine and router logs); None on a remote store, where the caller uses a temporary one."""
        fs, path = open_fs(self.uri(run_id, stage, *parts), self.storage_options)
        if not is_local(fs):
            return None
        fs.makedirs(path, exist_ok=True)
        return path

    def committed(self, run_id: str, stage: str) -> list[str]:
        """Names of the committed artifacts of a stage, sorted (uncommitted leftovers are not listed)."""
        fs, path = open_fs(self.uri(run_id, stage), self.storage_options)
        if not fs.exists(path):
            return []
        names = []
        for entry in fs.ls(path, detail=False):
            if fs.exists(join_uri(entry, MANIFEST_NAME)):
                names.append(entry.rstrip("/").rsplit("/", 1)[-1])
        return sorted(names)

    def shard_writer(self, run_id: str, stage: str, name: str, **kwargs: Any) -> ShardSetWriter:
        """A writer for a new shard set `{run_id}/{stage}/{name}` (producer fields filled in)."""
        producer = {"run_id": run_id, "stage": stage, **kwargs.pop("producer", {})}
        return ShardSetWriter(
            self.uri(run_id, stage, name), producer=producer, storage_options=self.storage_options, **kwargs
        )

    def open_shards(self, run_id: str, stage: str, name: str) -> ShardSet:
        return ShardSet.open(self.uri(run_id, stage, name), self.storage_options)
