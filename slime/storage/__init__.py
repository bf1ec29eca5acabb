"""The fsspec artifact store: run/stage layout, Arrow shard sets, manifests committed last."""

from slime.storage.manifest import (
    Manifest,
    commit_directory,
    is_committed,
    manifest_hash,
    read_manifest,
    reusable_manifest,
)
from slime.storage.schema import SAMPLE_SCHEMA, SCHEMA_VERSION
from slime.storage.shards import ShardSet, ShardSetWriter, read_samples, write_samples
from slime.storage.store import ArtifactStore

__all__ = [
    "SAMPLE_SCHEMA",
    "SCHEMA_VERSION",
    "ArtifactStore",
    "Manifest",
    "ShardSet",
    "ShardSetWriter",
    "commit_directory",
    "is_committed",
    "manifest_hash",
    "read_manifest",
    "read_samples",
    "reusable_manifest",
    "write_samples",
]
