"""The sft flow trains with SFT's own schedule and caches on it: changing RL's learning rate alone reuses a
finished SFT; changing SFT's re-runs it."""

import json
from pathlib import Path

import pytest

import tasks.sft
from flows.convert import convert_flow
from flows.sft import sft_flow

TINY_CPU = Path(__file__).resolve().parents[2] / "deployments" / "tiny-cpu.yaml"


@pytest.fixture
def sft_calls(monkeypatch):
    seen = []
    real = tasks.sft.run_sft

    def spy(config):
        seen.append(config.train.lr)
        return real(config)

    monkeypatch.setattr(tasks.sft, "run_sft", spy)
    return seen


def test_sft_cache_follows_the_sft_schedule_not_rls(prefect_api, tiny_kit, tmp_path, sft_calls):
    base = ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]", "--sft-num-epoch", "1",
            "--sft-lr", "2e-3", "--global-batch-size", "32", "--micro-batch-size", "32"]
    params = {"config": str(TINY_CPU), "store": str(tmp_path / "store"), "run_id": "s"}
    convert_flow(**params, overrides=base)  # sft starts from the run's convert checkpoint
    first = sft_flow(**params, overrides=[*base, "--lr", "3e-5"])
    assert first["status"] == "ran" and sft_calls == [2e-3]  # SFT trained at sft_lr
    checkpoint = Path(first["artifacts"]["checkpoint"]["uri"])
    scheduler = json.loads((checkpoint / "training_state.json").read_text())["scheduler"]
    assert scheduler["max_lr"] == 2e-3
    assert sft_flow(**params, overrides=[*base, "--lr", "1e-6"])["status"] == "cached"  # only RL's lr changed
    assert sft_calls == [2e-3]
    again = sft_flow(**params, overrides=[*base, "--lr", "1e-6", "--sft-lr", "1e-3"])
    assert again["status"] == "ran" and sft_calls == [2e-3, 1e-3]
