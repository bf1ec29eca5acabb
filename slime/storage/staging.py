"""Checkpoints and HF directories in an object store, for code that reads and writes them as files.

Megatron's torch_dist, safetensors, transformers and the engines all want local paths. `staged(config)`
gives a stage a copy of its config in which every remote location of such a directory is a local one:

* inputs (`checkpoint.load`, `checkpoint.ref_load`, `checkpoint.opd_teacher_load`, an HF directory): the committed
  artifact (or, for a `--save` root, its newest committed `iter_*`; for `ref_load` with `checkpoint.ref_ckpt_step`
  or `opd_teacher_load` with `opd_teacher_ckpt_step`, that
  iteration, in a local root of the same layout) is downloaded into the staging directory, every file
  checked against the manifest's size and sha256, the manifest written last, so a half download is
  never taken for a copy;
* outputs (`checkpoint.save`, `checkpoint.save_hf`, `export.output_dir`): a local directory, first filled
  with the remote's newest committed checkpoint (a resume finds it), whose newly committed artifacts are
  uploaded when the block ends (files first, the manifest last, so the remote copy becomes visible only
  whole). `publish()` uploads earlier, e.g. after each save.

The staging directory is `run.staging_dir` (default: `slime-staging` in the system's temp directory),
one sub-directory per remote URL, kept between runs: a rerun on the same machine downloads nothing again.
A download holds a machine-wide file lock on its directory, so processes of one machine that stage the same
artifact download it once (the others wait, then find it there). Local locations pass through untouched.
Train ranks on other machines than the driver stage their own copies (`slime/storage/node_staging.py`).
"""

from __future__ import annotations

import contextlib
import fcntl
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
from slime.storage.fs import is_local, join_uri, open_fs
from slime.storage.manifest import (
    MANIFEST_NAME,
    FileEntry,
    hash_entries,
    hash_file,
    is_committed,
    read_manifest,
)

logger = logging.getLogger(__name__)

_ITER = re.compile(r"^iter_(\d{7})$")
INPUT_FIELDS = ("checkpoint.load", "checkpoint.ref_load", "checkpoint.opd_teacher_load", "checkpoint.hf_checkpoint",
                "export.origin_hf_dir")
# an input checkpoint root -> the field that picks one of its iterations (else its newest committed one)
STEP_FIELDS = {"checkpoint.ref_load": "checkpoint.ref_ckpt_step",
               "checkpoint.opd_teacher_load": "checkpoint.opd_teacher_ckpt_step"}
OUTPUT_FIELDS = ("checkpoint.save", "checkpoint.save_hf", "export.output_dir")
# what a Megatron train rank reads or writes (slime/ray/train_actor.py): staged on its own node
TRAIN_FIELDS = ("checkpoint.load", "checkpoint.ref_load", "checkpoint.opd_teacher_load", "checkpoint.hf_checkpoint",
                "checkpoint.save")


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
    fs.invalidate_cache(path)  # other processes (train ranks on other nodes) commit here: list it afresh
    if not fs.exists(path):
        return None
    names = sorted((m.group(1), name) for entry in fs.ls(path, detail=False)
                   if (m := _ITER.match(name := entry.rstrip("/").rsplit("/", 1)[-1])))
    for _, name in reversed(names):
        child = join_uri(uri, name)
        if is_committed(child, storage_options):
            return child
    return None


@contextlib.contextmanager
def machine_lock(local: str) -> Iterator[None]:
    """An exclusive lock on `local` among this machine's processes: a `flock` on a file named by the hash of
    its real path in the temp directory (not beside it: a save root holds checkpoints only)."""
    digest = hashlib.sha256(os.path.realpath(local).encode()).hexdigest()[:16]
    lock = os.path.join(tempfile.gettempdir(), "slime-staging-locks", f"{digest}.lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def download(uri: str, local: str, storage_options: dict[str, Any] | None = None) -> str:
    """Copy the committed artifact at `uri` into `local` (files checked against its manifest, the manifest
    last); nothing is copied when `local` already holds the same manifest. Returns `local`. Under
    `machine_lock(local)`: concurrent callers on one machine download once."""
    with machine_lock(local):
        return _download(uri, local, storage_options)


def _download(uri: str, local: str, storage_options: dict[str, Any] | None) -> str:
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
    put_files(local, uri, [entry.path for entry in read_manifest(local).files], storage_options)
    fs.pipe_file(manifest_path, raw)
    logger.info("published %s to %s", local, uri)
    return uri


def put_files(local: str, uri: str, paths: list[str], storage_options: dict[str, Any] | None = None) -> None:
    """Upload the files `paths` (relative to `local`) to the same relative paths under `uri`."""
    fs, root = open_fs(uri, storage_options)
    for rel in paths:
        if is_local(fs):  # object stores have no directories to make
            fs.makedirs(f"{root.rstrip('/')}/{os.path.dirname(rel)}", exist_ok=True)
        fs.put_file(os.path.join(local, rel), f"{root.rstrip('/')}/{rel}")


def hash_files(local: str, paths: list[str]) -> list[FileEntry]:
    """Manifest entries (size, sha256, crc32) of the files `paths` relative to `local`."""
    local_fs, _ = open_fs(local)
    return hash_entries(local_fs, local, paths)


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
    fields: dict[str, str] = field(default_factory=dict)  # dotted config field -> its remote URL, as given

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


def stage(config: Any, root: str, fields: tuple[str, ...] = INPUT_FIELDS + OUTPUT_FIELDS) -> tuple[Any, Staging]:
    """(a copy of `config` whose remote `fields` are local directories under `root`, the `Staging`): inputs
    downloaded, outputs created and holding the remote's newest committed checkpoint (for a resume)."""
    options = config.run.storage_options
    staging = Staging(options)
    values: dict[str, str] = {}
    for dotted in INPUT_FIELDS:
        uri = _get(config, dotted)
        if dotted not in fields or not is_remote(uri):
            continue
        step_field = STEP_FIELDS.get(dotted)
        step = _get(config, step_field) if step_field else None
        if step is not None:  # that iteration of the root, staged as a root holding it (the step still applies)
            artifact, local, value = _iteration(uri, step, root, options, step_field, dotted)
        else:
            artifact = newest_committed(uri, options)
            if artifact is None:
                raise NotCommittedError(f"{dotted}: {uri} holds no committed artifact (no {MANIFEST_NAME}, no "
                                        "committed iter_*)")
            local = value = local_path(root, artifact)
        download(artifact, local, options)
        staging.inputs[local] = artifact
        staging.fields[dotted] = uri
        values[dotted] = value
    for dotted in OUTPUT_FIELDS:
        uri = _get(config, dotted)
        if dotted not in fields or not is_remote(uri):
            continue
        local = local_path(root, uri)
        os.makedirs(local, exist_ok=True)
        newest = newest_committed(uri, options)
        if newest is not None and newest != uri:  # a save root: its newest checkpoint, for a resume
            download(newest, os.path.join(local, newest.rstrip("/").rsplit("/", 1)[-1]), options)
        staging.outputs[local] = uri
        staging.fields[dotted] = uri
        values[dotted] = local
    return with_values(config, values), staging


def _iteration(uri: str, step: int, root: str, options: dict[str, Any] | None, step_field: str,
               root_field: str) -> tuple[str, str, str]:
    """(the remote iteration `step` of the save root `uri`, its local copy, the local root holding it) for
    `step_field` (e.g. `checkpoint.ref_ckpt_step`); a clear error when the store has not committed it."""
    name = f"iter_{step:07d}"
    artifact = join_uri(uri, name)
    if not is_committed(artifact, options):
        raise NotCommittedError(f"{step_field} {step}: {artifact} is not a committed checkpoint "
                                f"({root_field} must be a --save root holding it)")
    value = local_path(root, uri)
    return artifact, os.path.join(value, name), value


def with_values(config: Any, values: dict[str, str]) -> Any:
    """A copy of `config` with the dotted fields of `values` replaced (`config` itself when none)."""
    if not values:
        return config
    sections: dict[str, dict[str, str]] = {}
    for dotted, value in values.items():
        section, name = dotted.split(".")
        sections.setdefault(section, {})[name] = value
    return config.model_copy(update={s: getattr(config, s).model_copy(update=v) for s, v in sections.items()})


@contextlib.contextmanager
def staged(config: Any) -> Iterator[tuple[Any, Staging]]:
    """(a copy of `config` with its remote checkpoint and HF locations made local, the `Staging`); new
    committed outputs are uploaded when the block ends without an error."""
    local_config, staging = stage(config, staging_root(config))
    yield local_config, staging
    staging.publish()
