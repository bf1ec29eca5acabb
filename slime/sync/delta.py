"""Delta weight sync over disk (slime's `--update-weight-mode delta`, disk transport): each sync ships only
the bytes that changed since the previous one, with a checksum per tensor.

Trainer side (`DeltaSync`): a CPU snapshot of the weights last sent. Each sync compares every tensor
byte for byte with it and writes, for the tensors that changed, one delta directory
`{update_weight_disk_dir}/delta_<version>/`: `data.bin` (each tensor's delta, zstd-compressed, one after
the other) and `index.json` (base version, encoding, checksum algorithm; per tensor: name, dtype, shape,
byte size, offset and length in data.bin, checksum of its new bytes). The encodings are slime's, byte-level
and dtype-blind:

* `xor`: new ^ old over the tensor's bytes (unchanged bytes are zeros and compress away); an involution, so
  it must be applied exactly once, to the right base;
* `overwrite`: the positions (int64) of the changed bytes and their new values; larger, re-applicable.

Host side (`apply_delta`): patch the full HF checkpoint in `update_weight_local_checkpoint_dir` with a delta,
check every patched tensor against its checksum, and publish each rewritten file by rename; the engines then
reload that directory with `/update_weights_from_disk`. The first sync of a syncer (no snapshot yet) writes
the full checkpoint there. Departure from slime: its engines pull and apply the deltas themselves
(`/pull_weights`, not an SGLang endpoint); here the syncer applies them, so trainer rank 0 and the engines
share the local checkpoint directory's file system.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import load_file, save_file

from slime.backends.megatron.hf_export import save_hf_weights
from slime.delta_codec import checksum, decode, encode, tensor_bytes
from slime.engines.client import EngineClient
from slime.errors import CorruptArtifactError
from slime.sync.common import NamedTensors, SyncResult, Timer, in_thread, post_all

INDEX, DATA = "index.json", "data.bin"
FORMAT = "slime-delta-v1"
def write_delta(directory: Path, version: str, base_version: str, changes: list[tuple[str, torch.Tensor, bytes]],
                encoding: str, algorithm: str) -> int:
    """Write `changes` (name, new tensor, uncompressed delta) as delta directory `directory`; its data.bin
    size in bytes (what crosses the wire)."""
    directory.mkdir(parents=True, exist_ok=True)
    entries, offset = [], 0
    with open(directory / DATA, "wb") as data:
        for name, tensor, delta in changes:
            packed = pa.compress(delta, codec="zstd", asbytes=True) if delta else b""
            data.write(packed)
            entries.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                            "shape": list(tensor.shape), "nbytes": len(delta), "offset": offset,
                            "length": len(packed), "checksum": checksum(tensor_bytes(tensor), algorithm)})
            offset += len(packed)
    index = {"format": FORMAT, "version": version, "base_version": base_version, "encoding": encoding,
             "checksum": algorithm, "tensors": entries}
    (directory / INDEX).write_text(json.dumps(index, indent=1))  # written last: a complete delta has it
    return offset


def apply_delta(checkpoint_dir: str | Path, delta_dir: str | Path) -> dict[str, Any]:
    """Patch the HF checkpoint in `checkpoint_dir` with the delta in `delta_dir`; every patched tensor must
    match its checksum (else `CorruptArtifactError`, checkpoint untouched). Returns {"tensors", "files"}."""
    checkpoint_dir, delta_dir = Path(checkpoint_dir), Path(delta_dir)
    index = json.loads((delta_dir / INDEX).read_text())
    if index.get("format") != FORMAT:
        raise CorruptArtifactError(f"{delta_dir / INDEX}: not a {FORMAT} delta")
    blob = (delta_dir / DATA).read_bytes()
    wanted = {entry["name"]: entry for entry in index["tensors"]}
    patched: dict[Path, dict[str, torch.Tensor]] = {}
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        names = wanted.keys() & tensors.keys()
        for name in names:
            entry = wanted[name]
            old = tensors[name]
            packed = blob[entry["offset"]: entry["offset"] + entry["length"]]
            delta = pa.decompress(packed, decompressed_size=entry["nbytes"], codec="zstd", asbytes=True) \
                if entry["nbytes"] else b""
            new = decode(tensor_bytes(old), delta, index["encoding"])
            if checksum(new, index["checksum"]) != entry["checksum"]:
                raise CorruptArtifactError(f"{delta_dir}: tensor {name!r} does not match its {index['checksum']} "
                                           f"checksum after applying the {index['encoding']} delta (wrong base "
                                           f"checkpoint? base version {index['base_version']})")
            tensors[name] = torch.from_numpy(new).view(old.dtype).reshape(old.shape)
        if names:
            patched[path] = tensors
    missing = wanted.keys() - {n for tensors in patched.values() for n in tensors}
    if missing:
        raise CorruptArtifactError(f"{delta_dir}: tensors {sorted(missing)[:5]} are not in {checkpoint_dir}")
    for path, tensors in patched.items():  # only after every check passed
        tmp = path.with_suffix(".safetensors.tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
    return {"tensors": len(wanted), "files": len(patched)}


class DeltaSync:
    """Disk transport that sends deltas against the previous sync (full weights the first time)."""

    def __init__(self, directory: str | Path, local_dir: str | Path, hf_config: Any = None, *, encoding: str = "xor",
                 algorithm: str = "xxh3-128", keep_files: bool = False,
                 post_write: Callable[[str, list[str]], Any] | None = None) -> None:
        self.directory = Path(directory)
        self.local_dir = Path(local_dir)
        self.hf_config = hf_config
        self.encoding, self.algorithm = encoding, algorithm
        self.keep_files = keep_files
        self.post_write = post_write
        self.snapshot: dict[str, np.ndarray] | None = None  # bytes of the weights the engines hold
        self.base_version: str | None = None
        self._previous: Path | None = None

    def _full(self, weights: NamedTensors, result: SyncResult) -> None:
        snapshot: dict[str, np.ndarray] = {}

        def keep() -> NamedTensors:
            for name, tensor in weights:
                snapshot[name] = tensor_bytes(tensor)
                result.tensors += 1
                result.bytes += snapshot[name].size
                yield name, tensor

        if self.local_dir.exists():
            shutil.rmtree(self.local_dir)
        save_hf_weights(keep(), str(self.local_dir))
        if self.hf_config is not None:
            self.hf_config.save_pretrained(str(self.local_dir))
        self.snapshot = snapshot

    def _delta(self, weights: NamedTensors, version: str, result: SyncResult) -> Path:
        assert self.snapshot is not None
        changes, seen = [], set()
        for name, tensor in weights:
            new = tensor_bytes(tensor)
            old = self.snapshot.get(name)
            seen.add(name)
            if old is None or old.size != new.size:
                raise ValueError(f"tensor {name!r} is new or changed size since the last sync: delta sync needs the "
                                 "same tensors every time")
            if not np.array_equal(old, new):
                changes.append((name, tensor, encode(old, new, self.encoding)))
                self.snapshot[name] = new
        if seen != self.snapshot.keys():
            raise ValueError(f"tensors {sorted(self.snapshot.keys() - seen)[:5]} were not exported this sync")
        target = self.directory / f"delta_{version}"
        if target.exists():
            shutil.rmtree(target)
        result.bytes = write_delta(target, version, self.base_version or "", changes, self.encoding, self.algorithm)
        result.tensors = len(changes)
        return target

    async def send(self, client: EngineClient, urls: list[str], weights: NamedTensors, version: str,
                   result: SyncResult, timer: Timer, state: str) -> None:
        target: Path | None = None

        def export() -> None:
            nonlocal target
            if self.snapshot is None:
                self._full(weights, result)
            else:
                target = self._delta(weights, version, result)

        with timer("export"):
            await in_thread(export)
        if self.post_write is not None:  # slime: after a full or delta write, before any engine reads it
            written = str(target or self.local_dir)
            with timer("post_write"):
                await in_thread(lambda: self.post_write(written, list(urls)))
        if target is not None:
            with timer("apply"):
                await in_thread(lambda: apply_delta(self.local_dir, target))
        result.buckets = 1
        with timer("transfer"):
            await post_all(client, urls, "/update_weights_from_disk",
                           {"model_path": str(self.local_dir), "weight_version": version}, phase="update",
                           state=state)
        self.base_version = version
        if self._previous is not None and not self.keep_files:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = target

    async def close(self, client: EngineClient) -> None:
        return None
