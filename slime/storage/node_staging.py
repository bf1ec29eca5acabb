"""Megatron checkpoints of a remote store from train ranks on any node, without a shared file system.

The driver stages its own copies (`staging.py`); train ranks on other machines cannot read those. When
train ranks run on other nodes than the driver, each rank stages the train fields itself
(`stage_on_node`: `checkpoint.load`, `ref_load`, `hf_checkpoint`, and the newest committed checkpoint of
`save` for a resume) under its node's staging directory; `download`'s machine lock makes that one
download per node, whatever the number of ranks there. A save (`commit_from_nodes`, collective) writes
each rank's torch_dist files into its node's staging directory; the lowest rank of each node uploads its
node's files to the remote iteration directory; after a barrier rank 0 writes the manifest, listing every
node's files, to the store last: a reader sees a whole checkpoint or none. No node's local directory is
committed (it holds only that node's share), so nothing local is ever taken for the checkpoint.

The node's staging directory is `$SLIME_NODE_STAGING_DIR` when set (e.g. a node's local disk, or one
directory per simulated node of a one-machine test cluster), else `run.staging_dir`, else the system
temp directory's `slime-staging`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from slime.errors import AlreadyCommittedError, CorruptArtifactError
from slime.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, commit_manifest, read_manifest
from slime.storage.staging import (
    TRAIN_FIELDS,
    Staging,
    hash_files,
    put_files,
    stage,
    staging_root,
    with_values,
)

logger = logging.getLogger(__name__)

NODE_STAGING_ENV = "SLIME_NODE_STAGING_DIR"


def node_staging_root(config: Any) -> str:
    return os.environ.get(NODE_STAGING_ENV) or staging_root(config)


def stage_on_node(config: Any, remote_fields: dict[str, str]) -> tuple[Any, Staging]:
    """`config` with the train fields of `remote_fields` (dotted field -> remote URL) staged on this node
    (downloads once per node); the `Staging` maps this node's `save` directory back to its URL."""
    fields = {k: v for k, v in remote_fields.items() if k in TRAIN_FIELDS}
    return stage(with_values(config, fields), node_staging_root(config), tuple(fields))


def node_files(local: str) -> list[str]:
    """Every file under `local` (relative paths, sorted), a manifest and its temp files aside."""
    found = []
    for dirpath, _, names in os.walk(local):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), local)
            if rel != MANIFEST_NAME and not rel.startswith(f"{MANIFEST_NAME}.tmp-"):
                found.append(rel)
    return sorted(found)


def merge_entries(shares: list[list[FileEntry]], uri: str) -> list[FileEntry]:
    """One entry per path from every node's share; a path two nodes wrote with different contents is an
    error (each rank's torch_dist files have their own names, common files are rank 0's only)."""
    merged: dict[str, FileEntry] = {}
    for share in shares:
        for entry in share:
            seen = merged.setdefault(entry.path, entry)
            if seen.sha256 != entry.sha256:
                raise CorruptArtifactError(f"{uri}/{entry.path}: two nodes wrote different contents "
                                           f"({seen.sha256[:12]}, {entry.sha256[:12]})")
    return [merged[path] for path in sorted(merged)]


def is_node_leader(local: str) -> bool:
    """Whether this rank is the lowest of those that see `local` on this host (a collective call): the one
    that cleans and uploads the node's directory."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    key = f"{socket.gethostname()}:{os.path.realpath(local)}"
    return _all_gather(key).index(key) == rank


def commit_from_nodes(local: str, uri: str, storage_options: dict[str, Any] | None,
                      make_manifest: Callable[[list[FileEntry]], Manifest]) -> Manifest:
    """Upload a checkpoint written by all ranks into their nodes' `local` directories to `uri`, and commit
    it there (a collective over the default process group; every rank calls it after its files are
    written). Rank 0's `make_manifest(entries)` builds the manifest, published last. Returns it."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    share: list[FileEntry] = []
    if is_node_leader(local):  # the lowest rank of this node uploads the node's files
        paths = node_files(local)
        share = hash_files(local, paths)
        put_files(local, uri, paths, storage_options)
        logger.info("rank %d uploaded %d files (%.1f MB) of %s to %s", rank, len(paths),
                    sum(e.bytes for e in share) / 1e6, local, uri)
    shares = _all_gather([e.model_dump(mode="json") for e in share])
    error = None
    if rank == 0:
        try:
            manifest = make_manifest(merge_entries([[FileEntry(**e) for e in s] for s in shares], uri))
            commit_manifest(uri, manifest, storage_options)
        except (AlreadyCommittedError, CorruptArtifactError) as exc:
            error = str(exc)
    errors = _all_gather(error)
    if errors[0] is not None:
        raise CorruptArtifactError(f"committing {uri}: {errors[0]}")
    return read_manifest(uri, storage_options)


def _all_gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
