"""The store on s3:// against a local S3 server (moto) bound to 127.0.0.1."""

import pytest
from conftest import make_samples, moto_s3_options

from slime.errors import AlreadyCommittedError, CorruptArtifactError
from slime.storage import ArtifactStore, ShardSet, read_samples, write_samples


@pytest.fixture(scope="module")
def s3_options():
    yield from moto_s3_options("slime-runs")


def test_round_trip_commit_and_corruption_on_s3(s3_options):
    store = ArtifactStore("s3://slime-runs/exp", s3_options)
    samples = make_samples(50)
    uri = store.uri("run1", "rollout", "000000")
    assert uri == "s3://slime-runs/exp/run1/rollout/000000"
    write_samples(uri, samples, target_file_bytes=2_000, storage_options=s3_options)
    assert store.committed("run1", "rollout") == ["000000"]
    assert read_samples(uri, s3_options) == samples

    with pytest.raises(AlreadyCommittedError):
        from slime.storage.manifest import commit_manifest, read_manifest

        commit_manifest(uri, read_manifest(uri, s3_options), s3_options)

    import fsspec

    fs = fsspec.filesystem("s3", **s3_options)
    part = sorted(p for p in fs.ls(uri.removeprefix("s3://")) if "part-" in p)[0]
    data = bytearray(fs.cat_file(part))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(part, bytes(data))
    with pytest.raises(CorruptArtifactError, match="crc32"):
        ShardSet.open(uri, s3_options).read_samples()
    problems = ShardSet.open(uri, s3_options).verify()
    assert len(problems) == 1 and "sha256" in problems[0]
