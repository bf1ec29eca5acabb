"""Checkpoint directories without a usable manifest are refused before any tensor is read, and the typed
optimizer / LR-schedule fields win over the Megatron pass-through section."""

import json

import pytest

from slime.backends.megatron.checkpoint import (
    CHECKPOINT_KIND,
    ModelOnlyCheckpointError,
    UncommittedCheckpointError,
    latest_checkpoint,
    read_checkpoint_manifest,
    read_training_state,
)
from slime.config import load_config
from slime.errors import ConfigError, CorruptArtifactError, NotCommittedError
from slime.storage import commit_directory


def fake_checkpoint(root, iteration: int, commit: bool = True):
    path = root / f"iter_{iteration:07d}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "__0_0.distcp").write_bytes(b"x" * 64)
    (path / "training_state.json").write_text(json.dumps({"iteration": iteration}))
    if commit:
        commit_directory(str(path), CHECKPOINT_KIND, metadata={"iteration": iteration})
    return path


def test_directory_without_manifest_is_refused(tmp_path):
    path = fake_checkpoint(tmp_path, 3, commit=False)
    with pytest.raises(UncommittedCheckpointError, match="manifest.json is missing") as err:
        read_checkpoint_manifest(str(path))
    # both a configuration error and a not-committed artifact, for either kind of caller
    assert isinstance(err.value, ConfigError) and isinstance(err.value, NotCommittedError)
    assert latest_checkpoint(str(tmp_path)) is None


def test_latest_skips_an_uncommitted_newer_iteration(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4, commit=False)  # a save that crashed before its manifest
    assert latest_checkpoint(str(tmp_path)).endswith("iter_0000002")


def test_corrupt_manifest_is_refused(tmp_path):
    path = fake_checkpoint(tmp_path, 1)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptArtifactError, match="unreadable manifest"):
        read_checkpoint_manifest(str(path))


def test_file_that_differs_from_its_manifest_is_refused(tmp_path):
    path = fake_checkpoint(tmp_path, 1)
    (path / "model" / "__0_0.distcp").write_bytes(b"x" * 10)  # truncated after the commit
    with pytest.raises(CorruptArtifactError, match=r"__0_0.distcp: missing or not the 64 bytes"):
        read_checkpoint_manifest(str(path))
    (path / "model" / "__0_0.distcp").unlink()
    with pytest.raises(CorruptArtifactError, match="missing"):
        read_checkpoint_manifest(str(path))


def test_other_artifact_kind_is_refused(tmp_path):
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text("{}")
    commit_directory(str(path), "hf_model")
    with pytest.raises(ConfigError, match="committed 'hf_model', not a checkpoint"):
        read_checkpoint_manifest(str(path))


def test_schedule_and_optimizer_fields_are_typed(tmp_path):
    cfg = load_config(None, ["--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--min-lr", "1e-7",
                             "--optimizer", "sgd", "--use-distributed-optimizer", "--adam-beta2", "0.95"])
    t = cfg.train
    assert (t.lr_decay_style, t.lr_warmup_iters, t.min_lr, t.optimizer) == ("cosine", 5, 1e-7, "sgd")
    assert t.use_distributed_optimizer is True and t.adam_beta2 == 0.95 and cfg.megatron == {}
    path = tmp_path / "c.yaml"
    path.write_text("megatron:\n  lr_decay_style: cosine\n")
    with pytest.raises(ConfigError, match=r"megatron.lr_decay_style: lr_decay_style is a typed field: set it as "
                                          r"train.lr_decay_style \(--lr-decay-style\)"):
        load_config(path)


@pytest.mark.parametrize(("overrides", "message"), [
    (["--lr", "1e-4", "--min-lr", "1e-3"], "min_lr 0.001 is above lr 0.0001"),
    (["--lr-warmup-iters", "10", "--lr-decay-iters", "10"], "lr_warmup_iters 10 must be below lr_decay_iters 10"),
    (["--lr-decay-style", "WSD"], "WSD needs lr_wsd_decay_iters"),
    (["--lr-decay-style", "exponential"], "lr_decay_style"),
])
def test_inconsistent_schedules_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_training_state_is_readable_before_loading(tmp_path):
    path = tmp_path / "iter_0000005"
    path.mkdir()
    (path / "training_state.json").write_text(json.dumps({"iteration": 5, "scheduler": None,
                                                          "extra_state": {"cursor": 40}}))
    commit_directory(str(path), CHECKPOINT_KIND, metadata={"iteration": 5, "training_state": True})
    state = read_training_state(str(path))
    assert (state.iteration, state.extra_state) == (5, {"cursor": 40})
    model_only = fake_checkpoint(tmp_path, 6)
    with pytest.raises(ModelOnlyCheckpointError, match="holds the model only"):
        read_training_state(str(model_only))
