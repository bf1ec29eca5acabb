"""Checkpoints and HF directories in an object store, for code that reads and writes them as files.

Megatron's torch_dist, safetensors, transformers and the engines all want local paths. `staged(config)`
gives a stage a copy of its config in which every remote location of such a directory is a local one:

* inputs (`checkpoint.load`, `checkpoint.ref_load`, an HF directory): the committed artifact (or, for a
  `--save` root, its newest committed `iter_*`) is downloaded into the staging directory, every file
  checked against the manifest's size and sha256, the manifest written last, so a half download is
  never taken for a copy;
* outputs (`checkpoint.save`, `checkpoint.save_hf`, `export.output_dir`): a local directory, first filled
  with the remote's newest committed checkpoint (a resume finds it), whose newly committed artifacts are
  uploaded when the block ends (files first, the manifest last, so the remote copy becomes visible only
  whole). `publish()` uploads earlier, e.g. after each save.

The staging directory is `run.staging_dir` (default: `slime-staging` in the system's temp directory),
one sub-directory per remote URL, kept between runs: a rerun on the same machine downloads nothing again.
Local locations pass through untouched. Every node that reads a staged path must be this machine
(`slime.ray.placement.check_across_nodes` refuses train ranks on another IP).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime.errors import CorruptArtifactError, NotCommittedError
from slime.storage.fs import join_uri, open_fs
from slime.storage.manifest import MANIFEST_NAME, hash_file, is_committed, read_manifest

logger = logging.getLogger(__name__)

_ITER = re.compile(r"^iter_(\d{7})$")
INPUT_FIELDS = ("checkpoint.load", "checkpoint.ref_load", "checkpoint.hf_checkpoint", "export.origin_hf_dir")
OUTPUT_FIELDS = ("checkpoint.save", "checkpoint.save_hf", "export.output_dir")


def is_remote(uri: str | None) -> bool:
    """True for an fsspec URL that is not the local file system (s3://, gs://, memory://, ...)."""
    return bool(uri) and "://" in uri and not uri.startswith("file://")


def staging_root(config: Any) -> str:
    return config.run.staging_dir or os.path.join(tempfile.gettempdir(), "slime-staging")


def local_path(root: str, uri: str) -> str:
    """Where `uri` is staged under `root`: one directory per URL (a hash of it, then its last name)."""
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(root, f"{digest}-{uri.rstrip('/').rsplit('/', 1)[-1]}")


def newest_committed(uri: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """`uri` when it is a committed artifact, else its newest committed `iter_*` child, else None."""
    if is_committed(uri, storage_options):
        return uri
    fs, path = open_fs(uri, storage_options)
    if not fs.exists(path):
        return None
    names = sorted((m.group(1), name) for entry in fs.ls(path, detail=False)
                   if (m := _ITER.match(name := entry.rstrip("/").rsplit("/", 1)[-1])))
    for _, name in reversed(names):
        child = join_uri(uri, name)
        if is_committed(child, storage_options):
            return child
    return None


def download(uri: str, local: str, storage_options: dict[str, Any] | None = None) -> str:
    """Copy the committed artifact at `uri` into `local` (files checked against its manifest, the manifest
    last); nothing is copied when `local` already holds the same manifest. Returns `local`."""
    raw_fs, path = open_fs(join_uri(uri, MANIFEST_NAME), storage_options)
    try:
        raw = raw_fs.cat_file(path)
    except FileNotFoundError:
        raise NotCommittedError(f"{uri} is not a committed artifact ({MANIFEST_NAME} is missing)") from None
    target = os.path.join(local, MANIFEST_NAME)
    if os.path.isfile(target) and Path(target).read_bytes() == raw:
        return local
    manifest = read_manifest(uri, storage_options)
    fs, root = open_fs(uri, storage_options)
    local_fs, _ = open_fs(local)
    for entry in manifest.files:
        dest = os.path.join(local, entry.path)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fs.get_file(f"{root.rstrip('/')}/{entry.path}", dest)
        size, sha256, _ = hash_file(local_fs, dest)
        if size != entry.bytes or sha256 != entry.sha256:
            raise CorruptArtifactError(f"{uri}/{entry.path}: downloaded {size} bytes with sha256 {sha256[:12]}, the "
                                       f"manifest says {entry.bytes} bytes, {entry.sha256[:12]}")
    tmp = f"{target}.tmp-{os.getpid()}"
    Path(tmp).write_bytes(raw)
    os.replace(tmp, target)
    logger.info("staged %s (%d files, %.1f MB) in %s", uri, len(manifest.files),
                sum(e.bytes for e in manifest.files) / 1e6, local)
    return local


def upload(local: str, uri: str, storage_options: dict[str, Any] | None = None) -> str:
    """Copy the committed local artifact `local` to `uri`: its files, then its manifest (the remote copy is
    visible only once whole). Nothing is sent when `uri` holds the same manifest. Returns `uri`."""
    raw = Path(local, MANIFEST_NAME).read_bytes()
    fs, root = open_fs(uri, storage_options)
    manifest_path = f"{root.rstrip('/')}/{MANIFEST_NAME}"
    if fs.exists(manifest_path):
        if fs.cat_file(manifest_path) == raw:
            return uri
        raise CorruptArtifactError(f"{uri} holds another committed artifact than {local}; not overwritten")
    for entry in read_manifest(local).files:
        fs.put_file(os.path.join(local, entry.path), f"{root.rstrip('/')}/{entry.path}")
    fs.pipe_file(manifest_path, raw)
    logger.info("published %s to %s", local, uri)
    return uri


def local_copy(config: Any, uri: str) -> str:
    """`uri` itself when local, else its staged download (a committed artifact of the config's store)."""
    if not is_remote(uri):
        return uri
    return download(uri, local_path(staging_root(config), uri), config.run.storage_options)


@dataclass
class Staging:
    """The remote <-> local pairs of one `staged` block."""

    storage_options: dict[str, Any]
    outputs: dict[str, str] = field(default_factory=dict)  # local dir -> remote URL
    inputs: dict[str, str] = field(default_factory=dict)

    def to_remote(self, path: str) -> str:
        """The remote URL of a local staged path (or of a path under one); other paths unchanged."""
        for pairs in (self.outputs, self.inputs):
            for local, remote in pairs.items():
                if path == local or path.startswith(local.rstrip("/") + "/"):
                    return remote + path[len(local.rstrip("/")):]
        return path

    def publish(self) -> list[str]:
        """Upload every committed artifact under the output directories that the remote lacks."""
        sent = []
        for local, remote in self.outputs.items():
            if os.path.isfile(os.path.join(local, MANIFEST_NAME)):
                sent.append(upload(local, remote, self.storage_options))
                continue
            if not os.path.isdir(local):
                continue
            for name in sorted(os.listdir(local)):
                child = os.path.join(local, name)
                if _ITER.match(name) and os.path.isfile(os.path.join(child, MANIFEST_NAME)):
                    sent.append(upload(child, join_uri(remote, name), self.storage_options))
        return sent


def _get(config: Any, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


@contextlib.contextmanager
def staged(config: Any) -> Iterator[tuple[Any, Staging]]:
    """(a copy of `config` with its remote checkpoint and HF locations made local, the `Staging`); new
    committed outputs are uploaded when the block ends without an error."""
    options = config.run.storage_options
    staging = Staging(options)
    root = staging_root(config)
    values: dict[str, str] = {}
    for dotted in INPUT_FIELDS:
        uri = _get(config, dotted)
        if not is_remote(uri):
            continue
        artifact = newest_committed(uri, options)
        if artifact is None:
            raise NotCommittedError(f"{dotted}: {uri} holds no committed artifact (no {MANIFEST_NAME}, no committed "
                                    "iter_*)")
        local = download(artifact, local_path(root, artifact), options)
        staging.inputs[local] = artifact
        values[dotted] = local
    for dotted in OUTPUT_FIELDS:
        uri = _get(config, dotted)
        if not is_remote(uri):
            continue
        local = local_path(root, uri)
        os.makedirs(local, exist_ok=True)
        newest = newest_committed(uri, options)
        if newest is not None and newest != uri:  # a save root: its newest checkpoint, for a resume
            download(newest, os.path.join(local, newest.rstrip("/").rsplit("/", 1)[-1]), options)
        staging.outputs[local] = uri
        values[dotted] = local
    if not values:
        yield config, staging
        return
    sections: dict[str, dict[str, str]] = {}
    for dotted, value in values.items():
        section, name = dotted.split(".")
        sections.setdefault(section, {})[name] = value
    local_config = config.model_copy(update={s: getattr(config, s).model_copy(update=v) for s, v in sections.items()})
    yield local_config, staging
    staging.publish()
