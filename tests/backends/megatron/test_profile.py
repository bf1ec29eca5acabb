"""slime's profiling flags (slime/backends/megatron/profile.py) without a model: torch.profiler traces per
target and schedule, and the memory recorders' clear errors where they cannot run."""

import json

import pytest
import torch

from slime.backends.megatron.profile import TrainProfiler
from slime.config import load_config
from slime.errors import ConfigError


def _config(tmp_path, *flags: str):
    return load_config(None, ["--tensorboard-dir", str(tmp_path / "tb"), *flags])


def _work() -> None:
    torch.ones(32, 32) @ torch.ones(32, 32)


def test_train_overall_traces_the_scheduled_rollouts(tmp_path):
    config = _config(tmp_path, "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "2")
    profiler = TrainProfiler(config, rank=3)
    profiler.on_init_end()
    assert not (tmp_path / "tb").exists() or not list((tmp_path / "tb").iterdir())
    for rollout_id in range(3):  # wait 0, warmup 1 (rollout 0), active 1 (rollout 1): ready after it
        _work()
        profiler.step(rollout_id)
    profiler.close()
    files = [p.name for p in (tmp_path / "tb").iterdir()]
    assert len(files) == 1 and files[0].startswith("train_overall_rank_3.") and files[0].endswith(".json.gz")


def test_iterate_profiles_only_its_targets(tmp_path):
    config = _config(tmp_path, "--use-pytorch-profiler", "--profile-step-start", "0", "--profile-step-end", "2",
                     "--profile-target", "train_actor")
    profiler = TrainProfiler(config, rank=0)
    assert list(profiler.iterate("train_log_probs", range(3))) == [0, 1, 2]
    assert not (tmp_path / "tb").exists() or not list((tmp_path / "tb").iterdir())
    for _ in profiler.iterate("train_actor", range(3)):
        _work()
    assert [p.name.split(".")[0] for p in (tmp_path / "tb").iterdir()] == ["train_actor_rank_0"]
    # without megatron's use_pytorch_profiler nothing is profiled
    quiet = TrainProfiler(_config(tmp_path / "q", "--profile-target", "train_actor"), rank=0)
    assert list(quiet.iterate("train_actor", range(2))) == [0, 1] and not (tmp_path / "q").exists()


def test_nested_targets_and_empty_windows_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="one profiler at a time"):
        TrainProfiler(_config(tmp_path, "--use-pytorch-profiler", "--profile-target", "train_overall",
                              "train_actor"), rank=0)
    with pytest.raises(ConfigError, match="profile_step_end .* must be above"):
        TrainProfiler(_config(tmp_path, "--use-pytorch-profiler", "--profile-step-start", "3",
                              "--profile-step-end", "3"), rank=0)


def test_torch_memory_history_without_cuda_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = _config(tmp_path, "--record-memory-history", "--memory-snapshot-dir", str(tmp_path / "mem"))
    with pytest.raises(ConfigError, match="records the CUDA caching allocator.*memray"):
        TrainProfiler(config, rank=0)


def test_memray_needs_its_stop_step(tmp_path):
    with pytest.raises(ConfigError, match="memray needs memory_snapshot_num_steps"):
        load_config(None, ["--record-memory-history", "--memory-recorder", "memray"])


@pytest.mark.gpu
def test_torch_memory_history_is_dumped_as_json(tmp_path):
    config = _config(tmp_path, "--record-memory-history", "--memory-snapshot-dir", str(tmp_path / "mem"),
                     "--memory-snapshot-num-steps", "2")
    profiler = TrainProfiler(config, rank=0)
    for rollout_id in range(3):
        torch.ones(1024, 1024, device="cuda").sum()
        profiler.step(rollout_id)
    (snapshot,) = (tmp_path / "mem").iterdir()
    assert snapshot.suffix == ".json" and "segments" in json.loads(snapshot.read_text())
    profiler.close()
