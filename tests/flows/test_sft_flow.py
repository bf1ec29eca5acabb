"""The sft flow trains with SFT's own schedule and caches on it: changing RL's learning rate alone reuses a
finished SFT; changing SFT's is refused on the same run unless --overwrite. Stage commands and flows reuse
each other's committed stages."""

import json
from pathlib import Path

import pytest

import tasks.sft
from flows.convert import convert_flow
from flows.export import export_flow
from flows.sft import sft_flow
from slime import cli
from slime.errors import StageSettingsMismatch

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
    # another SFT schedule on the same run: refused by name, not silently reused nor replaced
    with pytest.raises(StageSettingsMismatch, match=r"sft\.sft_lr: 0\.002 -> 0\.001"):
        sft_flow(**params, overrides=[*base, "--lr", "1e-6", "--sft-lr", "1e-3"])
    assert sft_calls == [2e-3] and checkpoint.is_dir()
    again = sft_flow(**params, overrides=[*base, "--lr", "1e-6", "--sft-lr", "1e-3", "--overwrite"])
    assert again["status"] == "ran" and sft_calls == [2e-3, 1e-3]
    assert list(checkpoint.parent.parent.glob("checkpoint.replaced-*"))  # the first SFT, moved aside


def test_stage_commands_and_flows_reuse_what_the_other_committed(prefect_api, tiny_kit, tmp_path, sft_calls, capsys):
    """`slime convert` and `slime sft` commit a run's stages: the flows reuse them (Cached), and `slime export`
    reuses what the export flow committed; the record beside each output decides, whoever wrote it."""
    store = tmp_path / "store"
    base = ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]", "--sft-num-epoch", "1",
            "--global-batch-size", "32", "--micro-batch-size", "32"]
    command = ["--config", str(TINY_CPU), "--store", str(store), "--run-id", "c", *base]
    assert cli.main(["convert", *command]) == 0
    assert cli.main(["sft", *command, "--load", str(store / "c" / "convert" / "checkpoint")]) == 0
    params = {"config": str(TINY_CPU), "store": str(store), "run_id": "c", "overrides": base}
    assert convert_flow(**params)["status"] == "cached"
    sft = sft_flow(**params)
    assert sft["status"] == "cached" and sft_calls == []  # nothing trained again
    assert sft["artifacts"]["checkpoint"]["uri"].endswith("/c/sft/checkpoint/iter_0000002")
    exported = export_flow(**params, model=sft["artifacts"]["checkpoint"]["uri"])
    assert exported["status"] == "ran"
    capsys.readouterr()
    assert cli.main(["export", *command, "--load", str(store / "c" / "sft" / "checkpoint")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["reused"] is True and printed["artifacts"] == exported["artifacts"]
