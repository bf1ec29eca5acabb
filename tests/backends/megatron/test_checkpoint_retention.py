"""keep_checkpoints: `prune_checkpoints` keeps the newest N committed checkpoints, removes older ones and the
leftovers of saves that never committed before the newest, and never touches the newest committed one or a
newer save still being written; on a local directory and on an fsspec store."""

import json

import fsspec
import pytest
from test_checkpoint_manifest import fake_checkpoint

from slime.backends.megatron.checkpoint import CHECKPOINT_KIND, latest_checkpoint, prune_checkpoints
from slime.config import load_config
from slime.errors import ConfigError
from slime.storage import commit_directory


def names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keeps_the_newest_committed_and_what_is_still_being_written(tmp_path):
    for i in (1, 2, 3, 5):
        fake_checkpoint(tmp_path, i)
    fake_checkpoint(tmp_path, 4, commit=False)  # a save that crashed before its manifest
    fake_checkpoint(tmp_path, 6, commit=False)  # a save still in flight (--async-save)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    deleted = prune_checkpoints(str(tmp_path), keep=2)
    assert names(tmp_path) == ["iter_0000003", "iter_0000005", "iter_0000006", "notes.txt"]
    assert sorted(d.rsplit("/", 1)[-1] for d in deleted) == ["iter_0000001", "iter_0000002", "iter_0000004"]
    assert latest_checkpoint(str(tmp_path)).endswith("iter_0000005")
    assert prune_checkpoints(str(tmp_path), keep=1) == [str(tmp_path / "iter_0000003")]
    assert names(tmp_path) == ["iter_0000005", "iter_0000006", "notes.txt"]


def test_nothing_committed_prunes_nothing(tmp_path):
    fake_checkpoint(tmp_path, 1, commit=False)
    assert prune_checkpoints(str(tmp_path), keep=1) == []
    assert prune_checkpoints(str(tmp_path / "absent"), keep=1) == []
    assert names(tmp_path) == ["iter_0000001"]


def test_prunes_on_an_fsspec_store():
    fs = fsspec.filesystem("memory")
    root = "memory://retention-test/ckpt"
    for i in (1, 2, 3):
        path = f"{root}/iter_{i:07d}"
        fs.pipe(f"{path}/model/__0_0.distcp", b"x" * 32)
        fs.pipe(f"{path}/training_state.json", json.dumps({"iteration": i}).encode())
        commit_directory(path, CHECKPOINT_KIND, metadata={"iteration": i})
    try:
        deleted = prune_checkpoints(root, keep=1)
        assert [d.rsplit("/", 1)[-1] for d in deleted] == ["iter_0000001", "iter_0000002"]
        assert [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] == ["iter_0000003"]
    finally:
        fs.rm("/retention-test", recursive=True)


def test_keep_below_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="keep at least the newest"):
        prune_checkpoints(str(tmp_path), keep=0)
    with pytest.raises(ConfigError, match="keep_checkpoints"):
        load_config(None, ["--keep-checkpoints", "0"])


def test_async_save_and_keep_checkpoints_are_config_fields():
    config = load_config(None, ["--async-save", "--keep-checkpoints", "3"])
    assert config.checkpoint.async_save is True and config.checkpoint.keep_checkpoints == 3

