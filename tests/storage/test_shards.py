import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import make_samples

from slime.errors import (
    AlreadyCommittedError,
    CorruptArtifactError,
    NotCommittedError,
    SchemaVersionError,
    StorageError,
)
from slime.storage import ShardSet, ShardSetWriter, read_samples, write_samples
from slime.storage import manifest as manifest_mod
from slime.storage.manifest import Manifest, commit_manifest, file_entry, producer_info
from slime.storage.schema import _V1_SCHEMA, SAMPLE_SCHEMA, samples_to_batch
from slime.storage.shards import SHARD_SET_KIND


@pytest.mark.parametrize(("fmt", "compression"), [("arrow", None), ("arrow", "zstd"), ("parquet", None)])
def test_round_trip_is_exact_across_part_files(tmp_path, samples, fmt, compression):
    uri = str(tmp_path / "set")
    with ShardSetWriter(uri, format=fmt, compression=compression, target_file_bytes=2_000, config_hash="abc") as w:
        w.write(samples[:40])
        w.write(samples[40:])
    shard_set = ShardSet.open(uri)
    assert len(shard_set.manifest.files) > 1, "small target_file_bytes must split the set"
    assert shard_set.manifest.num_rows == len(samples) == len(shard_set)
    assert shard_set.manifest.config_hash == "abc"
    assert shard_set.manifest.format == fmt
    assert shard_set.read_samples() == samples
    assert shard_set.read_table().num_rows == len(samples)
    assert shard_set.verify() == []


def test_memory_filesystem_round_trip(samples):
    uri = "memory://slime-test/shards/a"
    try:
        manifest = write_samples(uri, samples, metadata={"rollout_id": 3})
        assert manifest.metadata == {"rollout_id": 3}
        assert read_samples(uri) == samples
    finally:
        import fsspec

        fsspec.filesystem("memory").rm("/slime-test", recursive=True)


def test_empty_set_commits_and_reads(tmp_path):
    uri = str(tmp_path / "empty")
    manifest = write_samples(uri, [])
    assert manifest.num_rows == 0 and manifest.files == []
    assert read_samples(uri) == []


def test_exception_mid_write_leaves_nothing_visible(tmp_path, samples):
    uri = tmp_path / "set"
    with pytest.raises(RuntimeError, match="boom"), ShardSetWriter(str(uri), target_file_bytes=1_000) as w:
        w.write(samples[:32])  # several part files are already on disk here
        assert list(uri.glob("part-*")), "parts should have been flushed before the failure"
        raise RuntimeError("boom")
    assert list(uri.glob("*")) == []
    with pytest.raises(NotCommittedError, match="manifest.json is missing"):
        ShardSet.open(str(uri))


def test_failure_while_committing_removes_parts(tmp_path, samples, monkeypatch):
    uri = tmp_path / "set"

    def broken_commit(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("slime.storage.shards.commit_manifest", broken_commit)
    with pytest.raises(OSError, match="disk full"):
        write_samples(str(uri), samples, target_file_bytes=1_000)
    assert list(uri.glob("*")) == []


def test_crashed_writer_is_not_readable(tmp_path, samples):
    uri = str(tmp_path / "set")
    writer = ShardSetWriter(uri, target_file_bytes=1_000)
    writer.write(samples)  # parts written, then the "process dies": no commit, no abort
    assert list(Path(uri).glob("part-*"))
    with pytest.raises(NotCommittedError):
        read_samples(uri)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_flipped_byte_is_detected(tmp_path, samples, fmt):
    uri = tmp_path / "set"
    write_samples(str(uri), samples, format=fmt, target_file_bytes=2_000)
    victim = sorted(uri.glob("part-*"))[1]
    _flip_byte(victim, victim.stat().st_size // 2)
    shard_set = ShardSet.open(str(uri))
    with pytest.raises(CorruptArtifactError, match=f"{victim.name}: crc32 [0-9a-f]{{8}} does not match manifest"):
        shard_set.read_samples()
    problems = shard_set.verify()  # the full audit checks sha256
    assert len(problems) == 1 and f"{victim.name}: sha256" in problems[0]


def test_entries_without_crc32_are_checked_with_sha256(tmp_path, samples):
    uri = tmp_path / "set"
    write_samples(str(uri), samples)
    doc = json.loads((uri / "manifest.json").read_text())
    for entry in doc["files"]:
        del entry["crc32"]
    (uri / "manifest.json").write_text(json.dumps(doc))
    assert read_samples(str(uri)) == samples
    part = next(uri.glob("part-*"))
    _flip_byte(part, 200)
    with pytest.raises(CorruptArtifactError, match=f"{part.name}: sha256 .* does not match manifest"):
        read_samples(str(uri))


def test_truncated_missing_and_bad_manifest(tmp_path, samples):
    uri = tmp_path / "set"
    write_samples(str(uri), samples, target_file_bytes=2_000)
    parts = sorted(uri.glob("part-*"))
    parts[0].write_bytes(parts[0].read_bytes()[:-10])
    parts[1].unlink()
    problems = ShardSet.open(str(uri)).verify()
    assert any("size" in p and parts[0].name in p for p in problems)
    assert any("missing" in p and parts[1].name in p for p in problems)
    with pytest.raises(CorruptArtifactError, match="listed in the manifest but missing|size"):
        read_samples(str(uri))
    (uri / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptArtifactError, match="unreadable manifest"):
        ShardSet.open(str(uri))


def test_wrong_schema_is_refused(tmp_path, samples):
    batch = samples_to_batch(samples[:2])
    other = pa.RecordBatch.from_arrays(batch.columns, schema=batch.schema.with_metadata({"slime.schema_version": "99"}))
    with ShardSetWriter(str(tmp_path / "a")) as w, pytest.raises(SchemaVersionError, match="schema version 99"):
        w.write_batch(other)
    no_meta = pa.table({"tokens": [[1, 2]]})
    with ShardSetWriter(str(tmp_path / "b")) as w, pytest.raises(SchemaVersionError, match="not a slime shard"):
        w.write_batch(no_meta)
    assert SAMPLE_SCHEMA.metadata[b"slime.schema_version"] == b"2"
    v1 = pa.RecordBatch.from_arrays([c for c, f in zip(batch.columns, batch.schema, strict=True)
                                     if f.name != "token_weight_versions"],
                                    schema=_V1_SCHEMA)
    with ShardSetWriter(str(tmp_path / "c")) as w, pytest.raises(SchemaVersionError, match="reads versions \\[2\\]"):
        w.write_batch(v1)  # an older layout is read, never written


def test_version_1_shards_still_read_with_token_versions_empty(tmp_path, samples):
    """A shard set written before token_weight_versions existed (schema 1) reads back whole, the new
    field None; a version-2 round trip keeps the per-token versions."""
    for s in samples:
        s.token_weight_versions = list(range(s.response_length))
    batch = samples_to_batch(samples)
    v1_batch = pa.RecordBatch.from_arrays([c for c, f in zip(batch.columns, batch.schema, strict=True)
                                           if f.name != "token_weight_versions"], schema=_V1_SCHEMA)
    uri = tmp_path / "v1"
    uri.mkdir()
    with pa.OSFile(str(uri / "part-00000.arrow"), "wb") as sink, pa.ipc.new_file(sink, _V1_SCHEMA) as writer:
        writer.write_batch(v1_batch)
    data = (uri / "part-00000.arrow").read_bytes()
    commit_manifest(str(uri), Manifest(kind=SHARD_SET_KIND, producer=producer_info(), files=[
        file_entry("part-00000.arrow", data, rows=len(samples))], num_rows=len(samples), schema_version=1,
        format="arrow"))
    old = read_samples(str(uri))
    assert [s.tokens for s in old] == [s.tokens for s in samples]
    assert all(s.token_weight_versions is None for s in old)
    write_samples(str(tmp_path / "v2"), samples)
    assert [s.token_weight_versions for s in read_samples(str(tmp_path / "v2"))] == \
        [list(range(s.response_length)) for s in samples]


def test_writer_refuses_committed_location_and_reuse(tmp_path, samples):
    uri = str(tmp_path / "set")
    write_samples(uri, samples)
    # the same error as losing the race at commit time: a writer that starts after another committed is refused
    # as AlreadyCommittedError too (the racing test saw a plain StorageError when its loser started late)
    with pytest.raises(AlreadyCommittedError, match="already a committed shard set"):
        ShardSetWriter(uri)
    writer = ShardSetWriter(str(tmp_path / "other"))
    writer.commit()
    with pytest.raises(StorageError, match="is committed"):
        writer.write(samples)


def _write_set(args):
    uri, start, n = args
    try:
        write_samples(uri, make_samples(n, start=start, seed=start), target_file_bytes=3_000)
        return "committed"
    except AlreadyCommittedError:
        return "refused"


def test_two_writers_in_one_run_do_not_interfere(tmp_path):
    stage = tmp_path / "run1" / "rollout"
    jobs = [(str(stage / "a"), 0, 200), (str(stage / "b"), 1000, 200)]
    with ProcessPoolExecutor(2) as pool:
        assert list(pool.map(_write_set, jobs)) == ["committed", "committed"]
    assert read_samples(jobs[0][0]) == make_samples(200, start=0, seed=0)
    assert read_samples(jobs[1][0]) == make_samples(200, start=1000, seed=1000)


def test_two_writers_racing_for_one_set(tmp_path):
    uri = str(tmp_path / "run1" / "rollout" / "same")
    jobs = [(uri, 0, 300), (uri, 5000, 300)]
    with ProcessPoolExecutor(2) as pool:
        outcomes = list(pool.map(_write_set, jobs))
    assert sorted(outcomes) == ["committed", "refused"]
    winner = jobs[outcomes.index("committed")]
    shard_set = ShardSet.open(uri)
    assert shard_set.read_samples() == make_samples(300, start=winner[1], seed=winner[1])
    assert shard_set.unreferenced_files() == []  # the loser removed its own parts
    assert shard_set.verify() == []


def test_manifest_is_written_last_and_is_json(tmp_path, samples, monkeypatch):
    uri = tmp_path / "set"
    seen = []
    real_commit = manifest_mod.commit_manifest

    def spy(u, manifest, storage_options=None):
        seen.append(sorted(p.name for p in uri.iterdir()))
        return real_commit(u, manifest, storage_options)

    monkeypatch.setattr("slime.storage.shards.commit_manifest", spy)
    write_samples(str(uri), samples, target_file_bytes=5_000)
    assert seen and "manifest.json" not in seen[0] and seen[0]
    doc = json.loads((uri / "manifest.json").read_text())
    assert doc["kind"] == "shard_set" and doc["schema_version"] == 2
    assert sum(f["rows"] for f in doc["files"]) == doc["num_rows"] == len(samples)
    assert {"host", "pid", "slime_version"} <= set(doc["producer"])


def test_upload_failure_in_background_surfaces_and_cleans_up(tmp_path, samples, monkeypatch):
    uri = tmp_path / "set"
    writer = ShardSetWriter(str(uri), target_file_bytes=1_000)
    real_pipe = writer._fs.pipe_file
    calls = []

    def flaky_pipe(path, data, **kwargs):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("connection reset")
        return real_pipe(path, data, **kwargs)

    monkeypatch.setattr(writer._fs, "pipe_file", flaky_pipe)
    with pytest.raises(OSError, match="connection reset"), writer:
        writer.write(samples)
    assert len(calls) >= 3
    assert list(uri.glob("*")) == []
