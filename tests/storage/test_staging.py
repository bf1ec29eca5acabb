"""Checkpoint and HF directories in an s3:// store (moto on 127.0.0.1), staged locally for code that wants files:
upload (files, then the manifest), download (checked against the manifest), and `staged(config)`: remote inputs
become local copies, a remote --save root becomes a local directory holding its newest checkpoint, and new
committed checkpoints are uploaded when the block ends."""

import os
from pathlib import Path

import fsspec
import pytest
from s3_server import moto_s3_options

from slime.config import Config
from slime.errors import CorruptArtifactError, NotCommittedError
from slime.storage import commit_directory, is_committed, read_manifest
from slime.storage.staging import download, newest_committed, staged, upload

BUCKET = "slime-staging"


@pytest.fixture(scope="module")
def s3_options():
    yield from moto_s3_options(BUCKET)


def checkpoint(path, payload: bytes) -> str:
    """A committed directory with two files, one nested (as torch_dist writes them)."""
    os.makedirs(os.path.join(path, "model"), exist_ok=True)
    with open(os.path.join(path, "model", "shard.distcp"), "wb") as f:
        f.write(payload)
    with open(os.path.join(path, "training_state.json"), "w") as f:
        f.write('{"iteration": 1}')
    commit_directory(str(path), "checkpoint")
    return str(path)


def test_upload_then_download_round_trip_and_a_corrupt_download_is_refused(tmp_path, s3_options):
    local = checkpoint(tmp_path / "ck", b"x" * 1000)
    uri = f"s3://{BUCKET}/a/ck"
    assert upload(local, uri, s3_options) == uri
    assert read_manifest(uri, s3_options) == read_manifest(local)
    assert upload(local, uri, s3_options) == uri  # the same artifact again: nothing to do
    other = checkpoint(tmp_path / "other", b"y" * 10)
    with pytest.raises(CorruptArtifactError, match="holds another committed artifact"):
        upload(other, uri, s3_options)

    copy = download(uri, str(tmp_path / "copy"), s3_options)
    assert Path(copy, "model", "shard.distcp").read_bytes() == b"x" * 1000
    assert is_committed(copy)

    fs = fsspec.filesystem("s3", **s3_options)
    fs.pipe_file(f"{BUCKET}/a/ck/model/shard.distcp", b"z" * 1000)  # same size, other bytes
    with pytest.raises(CorruptArtifactError, match="model/shard.distcp: downloaded 1000 bytes with sha256"):
        download(uri, str(tmp_path / "copy2"), s3_options)
    assert not is_committed(str(tmp_path / "copy2"))  # no manifest: the half copy is not taken for one
    with pytest.raises(NotCommittedError, match="is not a committed artifact"):
        download(f"s3://{BUCKET}/nothing", str(tmp_path / "copy3"), s3_options)


def test_staged_config_resumes_from_the_newest_remote_checkpoint_and_publishes_new_ones(tmp_path, s3_options):
    save = f"s3://{BUCKET}/run/rl/checkpoint"
    upload(checkpoint(tmp_path / "it1", b"1"), f"{save}/iter_0000001", s3_options)
    upload(checkpoint(tmp_path / "it2", b"22"), f"{save}/iter_0000002", s3_options)
    fsspec.filesystem("s3", **s3_options).pipe_file(f"{BUCKET}/run/rl/checkpoint/iter_0000003/partial", b"?")
    assert newest_committed(save, s3_options) == f"{save}/iter_0000002"  # iter 3 has no manifest
    load = f"s3://{BUCKET}/run/sft/checkpoint"
    upload(checkpoint(tmp_path / "sft", b"sft"), f"{load}/iter_0000007", s3_options)

    config = Config.model_validate({"run": {"store": f"s3://{BUCKET}/run", "storage_options": s3_options,
                                            "staging_dir": str(tmp_path / "staging")},
                                    "checkpoint": {"save": save, "load": load, "hf_checkpoint": "/local/model"}})
    with staged(config) as (local, staging):
        assert local.checkpoint.hf_checkpoint == "/local/model"  # local paths pass through
        assert local.checkpoint.load.startswith(str(tmp_path / "staging"))
        assert Path(local.checkpoint.load, "model", "shard.distcp").read_bytes() == b"sft"
        assert staging.to_remote(local.checkpoint.load) == f"{load}/iter_0000007"
        assert sorted(os.listdir(local.checkpoint.save)) == ["iter_0000002"]  # the newest, for a resume
        checkpoint(os.path.join(local.checkpoint.save, "iter_0000004"), b"4444")  # what the stage saves
        assert staging.to_remote(os.path.join(local.checkpoint.save, "iter_0000004")) == f"{save}/iter_0000004"
        assert not is_committed(f"{save}/iter_0000004", s3_options)  # uploaded when the block ends
    assert read_manifest(f"{save}/iter_0000004", s3_options).kind == "checkpoint"
    assert newest_committed(save, s3_options) == f"{save}/iter_0000004"


def test_a_failed_stage_publishes_nothing_and_local_configs_pass_through(tmp_path, s3_options):
    save = f"s3://{BUCKET}/failed/checkpoint"
    config = Config.model_validate({"run": {"storage_options": s3_options, "staging_dir": str(tmp_path / "s")},
                                    "checkpoint": {"save": save}})
    with pytest.raises(RuntimeError, match="stage died"), staged(config) as (local, _):
        checkpoint(os.path.join(local.checkpoint.save, "iter_0000001"), b"1")
        raise RuntimeError("stage died")
    assert newest_committed(save, s3_options) is None
    plain = Config.model_validate({"checkpoint": {"save": str(tmp_path / "ck")}})
    with staged(plain) as (same, staging):
        assert same is plain and staging.to_remote("/x") == "/x"
    missing = Config.model_validate({"run": {"storage_options": s3_options},
                                     "checkpoint": {"load": f"s3://{BUCKET}/none"}})
    with pytest.raises(NotCommittedError, match=f"checkpoint.load: s3://{BUCKET}/none holds no committed"), \
            staged(missing):
        pass
