import os
from pathlib import Path

import pytest
from conftest import make_samples

from slime.config import load_config
from slime.errors import ConfigError, NotCommittedError
from slime.storage import ArtifactStore, commit_directory, manifest_hash, read_manifest
from slime.storage.manifest import verify_files


def test_layout_and_name_checks(tmp_path):
    store = ArtifactStore(str(tmp_path / "runs"))
    assert store.uri("r1", "sft", "shards") == f"{tmp_path}/runs/r1/sft/shards"
    assert store.uri("r1") == f"{tmp_path}/runs/r1"
    for bad in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(ConfigError, match="must match"):
            store.uri(bad, "sft")


def test_relative_root_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ArtifactStore("./runs").root == os.path.join(str(tmp_path), "runs")
    assert ArtifactStore("file://" + str(tmp_path) + "/r/").root == f"{tmp_path}/r"
    assert ArtifactStore("s3://b/p/").root == "s3://b/p"


def test_from_config_and_committed_listing(tmp_path):
    config = load_config(None, ["--store", str(tmp_path), "--storage-options", "{}"])
    store = ArtifactStore.from_config(config)
    with store.shard_writer("run", "rollout", "000001") as w:
        w.write(make_samples(3))
    leftover = store.shard_writer("run", "rollout", "000002", target_file_bytes=10)
    leftover.write(make_samples(3))  # never committed
    assert store.committed("run", "rollout") == ["000001"]
    assert store.committed("run", "missing-stage") == []
    shard_set = store.open_shards("run", "rollout", "000001")
    assert shard_set.manifest.producer["run_id"] == "run"
    assert shard_set.manifest.producer["stage"] == "rollout"
    with pytest.raises(NotCommittedError):
        store.open_shards("run", "rollout", "000002")


def test_commit_directory_hashes_every_file_and_detects_changes(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000002").mkdir(parents=True)
    (ckpt / "iter_0000002" / "model.pt").write_bytes(b"\x00" * 1000)
    (ckpt / "latest.txt").write_text("2")
    manifest = commit_directory(str(ckpt), "checkpoint", config_hash="h", metadata={"rollout_id": 2})
    assert [f.path for f in manifest.files] == ["iter_0000002/model.pt", "latest.txt"]
    assert read_manifest(str(ckpt)).metadata == {"rollout_id": 2}
    before = manifest_hash(str(ckpt))
    assert verify_files(str(ckpt), manifest) == []
    (ckpt / "latest.txt").write_text("3")
    problems = verify_files(str(ckpt), manifest)
    assert len(problems) == 1 and problems[0].startswith(f"{ckpt}/latest.txt: sha256 ")
    assert manifest_hash(str(ckpt)) == before  # the manifest itself is unchanged
    with pytest.raises(NotCommittedError):
        read_manifest(str(tmp_path / "nothing"))


def test_local_dir_for_plain_files_is_under_the_run_or_none_when_remote(tmp_path):
    local = ArtifactStore(str(tmp_path / "runs")).local_dir("exp", "evaluate", "logs")
    assert local == str(tmp_path / "runs" / "exp" / "evaluate" / "logs") and Path(local).is_dir()
    assert ArtifactStore("memory://runs").local_dir("exp", "evaluate", "logs") is None
