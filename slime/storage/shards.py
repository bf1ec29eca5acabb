"""Shard sets: samples written as Arrow part files, visible only through a committed manifest.

A `ShardSetWriter` names its part files after a private writer id, so two writers never touch the
same file; it serialises each part in memory, hashes it and uploads it in one call (per-write
round trips through an fsspec file object are slow on object stores and for Parquet), and commits
the manifest last. If the `with` block raises, its files are deleted and nothing is published.
A `ShardSet` reads only the files the manifest lists and checks size, crc32, row count and schema
version of each before handing out a row; `verify()` audits the sha256 of every file.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from slime.errors import (
    AlreadyCommittedError,
    CorruptArtifactError,
    NotCommittedError,
    StorageError,
    StorageWriteError,
)
from slime.storage.fs import join_uri, open_fs
from slime.storage.manifest import (
    FileEntry,
    Manifest,
    commit_manifest,
    file_entry,
    is_committed,
    producer_info,
    read_manifest,
    read_verified,
    verify_files,
)
from slime.storage.schema import (
    SAMPLE_SCHEMA,
    SCHEMA_VERSION,
    check_schema,
    samples_to_batch,
    table_to_samples,
    upgrade_table,
)
from slime.types import Sample

logger = logging.getLogger(__name__)

ShardFormat = Literal["arrow", "parquet"]
SHARD_SET_KIND = "shard_set"
_SUFFIX = {"arrow": ".arrow", "parquet": ".parquet"}
_CONVERT_ROWS = 4096  # samples converted to Arrow per step
_READ_AHEAD = 2  # part files fetched and verified ahead of the reader


class ShardSetWriter:
    """Write samples to a new shard set at `uri`; `commit()` (or leaving the `with` block) publishes it.

    Args:
        uri: directory of the shard set (any fsspec URL); must not be committed already.
        format: "arrow" (IPC file, fastest) or "parquet" (smaller, zstd by default).
        compression: Arrow IPC "zstd"/"lz4" or None; Parquet codec name.
        config_hash: hash of the config that produced the data, recorded in the manifest.
        target_file_bytes: a part file is cut once its buffered batches reach this size.
    """

    def __init__(
        self,
        uri: str,
        *,
        format: ShardFormat = "arrow",
        compression: str | None = None,
        config_hash: str | None = None,
        producer: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        target_file_bytes: int = 64 * 1024**2,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if format not in _SUFFIX:
            raise ValueError(f"shard format must be one of {list(_SUFFIX)}, got {format!r}")
        self.uri = uri
        self.format = format
        self.compression = compression if compression is not None or format == "arrow" else "zstd"
        self.config_hash = config_hash
        self.producer = producer_info(**(producer or {}))
        self.metadata = dict(metadata or {})
        self.target_file_bytes = target_file_bytes
        self.storage_options = storage_options
        self.writer_id = uuid.uuid4().hex[:12]
        self._fs, self._root = open_fs(uri, storage_options)
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0
        self._files: list[FileEntry] = []
        # Parts are serialised, hashed and uploaded on one helper thread (those steps release the
        # GIL) while the caller converts the next samples; at most one part is in flight.
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="shard-writer")
        self._inflight: Future | None = None
        self._parts = 0
        self._state: Literal["open", "committed", "aborted"] = "open"
        if is_committed(uri, storage_options):
            raise AlreadyCommittedError(f"{uri} is already a committed shard set; write to a new location")

    # ------------------------------------------------------------------ writing

    def write(self, samples: Iterable[Sample]) -> None:
        """Buffer samples; a part file is written whenever the buffer reaches `target_file_bytes`."""
        samples = list(samples)
        for start in range(0, len(samples), _CONVERT_ROWS):  # chunks, so conversion overlaps uploads
            self.write_batch(samples_to_batch(samples[start : start + _CONVERT_ROWS]))

    def write_batch(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Buffer rows already in `SAMPLE_SCHEMA` form (for producers that build columns directly)."""
        self._require_open()
        check_schema(batch.schema, f"batch written to {self.uri}", current_only=True)
        batches = batch.to_batches() if isinstance(batch, pa.Table) else [batch]
        for b in batches:
            # slices of about target_file_bytes, so one large write still yields bounded part files
            step = max(1, int(self.target_file_bytes * b.num_rows / max(b.nbytes, 1)))
            for offset in range(0, b.num_rows, step):
                piece = b.slice(offset, step)
                self._pending.append(piece)
                self._pending_bytes += piece.nbytes
                if self._pending_bytes >= self.target_file_bytes:
                    self._flush()

    def _flush(self) -> None:
        """Hand the buffered batches to the upload thread as the next part file."""
        if not self._pending:
            return
        batches, self._pending, self._pending_bytes = self._pending, [], 0
        name = f"part-{self.writer_id}-{self._parts:05d}{_SUFFIX[self.format]}"
        self._parts += 1
        self._wait_inflight()
        self._inflight = self._uploader.submit(self._write_part, batches, name)

    def _wait_inflight(self) -> None:
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            inflight.result()  # re-raises an upload error in the caller's thread

    def _write_part(self, batches: list[pa.RecordBatch], name: str) -> None:
        table = pa.Table.from_batches(batches, schema=SAMPLE_SCHEMA)
        sink = pa.BufferOutputStream()
        if self.format == "arrow":
            options = ipc.IpcWriteOptions(compression=self.compression)
            with ipc.new_file(sink, SAMPLE_SCHEMA, options=options) as writer:
                writer.write_table(table)
        else:
            pq.write_table(table, sink, compression=self.compression)
        data = sink.getvalue()
        target = join_uri(self._root, name)
        try:
            self._fs.makedirs(self._root, exist_ok=True)
            # listed before the upload, so that abort() also removes a partially uploaded file
            self._files.append(file_entry(name, memoryview(data), rows=table.num_rows))
            self._fs.pipe_file(target, data.to_pybytes())
        except OSError as exc:  # disk full, permissions, a failed upload: name the file; the set stays uncommitted
            raise StorageWriteError(f"{target}: cannot write this part of shard set {self.uri}: "
                                    f"{exc.strerror or exc}; the shard set was not committed") from exc

    # ------------------------------------------------------------------ publishing

    def commit(self, metadata: dict[str, Any] | None = None) -> Manifest:
        """Write what is buffered and publish the manifest; afterwards the set is readable."""
        self._require_open()
        try:
            self._flush()
            self._wait_inflight()
            manifest = Manifest(
                kind=SHARD_SET_KIND,
                producer=self.producer,
                config_hash=self.config_hash,
                files=self._files,
                num_rows=sum(f.rows or 0 for f in self._files),
                schema_version=SCHEMA_VERSION,
                format=self.format,
                metadata={**self.metadata, **(metadata or {})},
            )
            commit_manifest(self.uri, manifest, self.storage_options)
        except BaseException:
            self.abort()
            raise
        self._state = "committed"
        self._uploader.shutdown()
        logger.info("committed shard set %s: %d rows in %d files", self.uri, manifest.num_rows, len(self._files))
        return manifest

    def abort(self) -> None:
        """Delete this writer's part files; nothing becomes visible."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._pending = []
        with contextlib.suppress(BaseException):
            self._wait_inflight()
        self._uploader.shutdown()
        for entry in self._files:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(join_uri(self._root, entry.path))
        logger.warning("aborted shard set writer %s for %s (%d files removed)", self.writer_id, self.uri,
                       len(self._files))

    def _require_open(self) -> None:
        if self._state != "open":
            raise StorageError(f"shard set writer for {self.uri} is {self._state}")

    def __enter__(self) -> ShardSetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.commit()


class ShardSet:
    """A committed shard set. Every read checks each file against the manifest first."""

    def __init__(self, uri: str, manifest: Manifest, storage_options: dict[str, Any] | None = None) -> None:
        self.uri = uri
        self.manifest = manifest
        self.storage_options = storage_options
        self._fs, self._root = open_fs(uri, storage_options)

    @classmethod
    def open(cls, uri: str, storage_options: dict[str, Any] | None = None) -> ShardSet:
        manifest = read_manifest(uri, storage_options)
        if manifest.kind != SHARD_SET_KIND:
            raise NotCommittedError(f"{uri} is a committed {manifest.kind!r}, not a shard set")
        return cls(uri, manifest, storage_options)

    def __len__(self) -> int:
        return self.manifest.num_rows or 0

    def iter_tables(self) -> Iterator[pa.Table]:
        """One verified table per part file, in manifest order.

        The next files are fetched and checksummed on helper threads while the current one is consumed.
        """
        files = self.manifest.files
        with ThreadPoolExecutor(_READ_AHEAD, thread_name_prefix="shard-reader") as pool:
            fetches = deque(self._fetch(pool, entry) for entry in files[:_READ_AHEAD])
            for i, entry in enumerate(files):
                data = fetches.popleft().result()
                if i + _READ_AHEAD < len(files):
                    fetches.append(self._fetch(pool, files[i + _READ_AHEAD]))
                yield self._parse(entry, data)

    def _fetch(self, pool: ThreadPoolExecutor, entry: FileEntry) -> Future:
        return pool.submit(read_verified, self._fs, join_uri(self._root, entry.path), entry, self.uri)

    def _parse(self, entry: FileEntry, buffer: pa.Buffer) -> pa.Table:
        where = join_uri(self.uri, entry.path)
        try:
            if self.manifest.format == "parquet":
                table = pq.read_table(pa.BufferReader(buffer))
            else:
                table = ipc.open_file(buffer).read_all()
        except pa.ArrowInvalid as exc:
            raise CorruptArtifactError(f"{where}: not a readable {self.manifest.format} file: {exc}") from None
        check_schema(table.schema, where)
        if entry.rows is not None and table.num_rows != entry.rows:
            raise CorruptArtifactError(f"{where}: {table.num_rows} rows, manifest says {entry.rows}")
        return upgrade_table(table)

    def read_table(self) -> pa.Table:
        tables = list(self.iter_tables())
        return pa.concat_tables(tables) if tables else SAMPLE_SCHEMA.empty_table()

    def iter_samples(self) -> Iterator[Sample]:
        for table in self.iter_tables():
            yield from table_to_samples(table)

    def read_samples(self) -> list[Sample]:
        return list(self.iter_samples())

    def verify(self) -> list[str]:
        """Full sha256 audit of the listed files without parsing them; [] when intact."""
        return verify_files(self.uri, self.manifest, self.storage_options)

    def unreferenced_files(self) -> list[str]:
        """Files in the set's directory that the manifest does not list (left by failed writers)."""
        listed = {e.path for e in self.manifest.files} | {"manifest.json"}
        names = [p.rsplit("/", 1)[-1] for p in self._fs.ls(self._root, detail=False)]
        return sorted(n for n in names if n not in listed)


def write_samples(uri: str, samples: Iterable[Sample], **kwargs: Any) -> Manifest:
    """Write `samples` as a new committed shard set at `uri` in one call."""
    writer = ShardSetWriter(uri, **kwargs)
    try:
        writer.write(samples)
    except BaseException:
        writer.abort()
        raise
    return writer.commit()


def read_samples(uri: str, storage_options: dict[str, Any] | None = None) -> list[Sample]:
    """All samples of the committed shard set at `uri`."""
    return ShardSet.open(uri, storage_options).read_samples()
