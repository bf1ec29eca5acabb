"""A stage's record: reuse only with the same settings; other settings refused, naming the fields."""

import json
from pathlib import Path

import pytest

from slime.backends.megatron.checkpoint import latest_checkpoint
from slime.config import load_config
from slime.errors import StageSettingsMismatch
from slime.stages.definitions import RL, SFT
from slime.stages.record import RECORD_SUFFIX, StageDefinition, begin_stage, read_record, same_settings
from slime.storage import commit_directory, manifest_hash

TINY_CPU = Path(__file__).resolve().parents[2] / "deployments" / "tiny-cpu.yaml"

# a stage of one input file and the `train` section, written to checkpoint.save
TOY = StageDefinition(name="toy", config_fields=("train.lr", "lora"), inputs=lambda c: {"data": c.sft.sft_data},
                      output=lambda c: c.checkpoint.save)
TOY_RESUMABLE = StageDefinition(name="toy", config_fields=("train.lr",), inputs=lambda c: {},
                                output=lambda c: c.checkpoint.save, resumable=True)


def toy_config(tmp_path, *extra):
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text('{"messages": []}\n')
    return load_config(None, ["--run-id", "r", "--store", str(tmp_path / "store"), "--save", str(tmp_path / "out"),
                              "--sft-data", str(data), *extra])


def committed_iteration(save, step, content=b"weights"):
    path = Path(save) / f"iter_{step:07d}"
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(content)
    commit_directory(str(path), "checkpoint")
    return path


def finish_with_checkpoint(start, step=1):
    ckpt = committed_iteration(start.output, step)
    start.finish({"stage": "toy", "artifacts": {"checkpoint": {"uri": str(ckpt), "manifest_hash": manifest_hash(
        str(ckpt))}}, "metrics": {"steps": step}, "seconds": {"toy": 1.0}, "rows": [1, 2, 3]})
    return ckpt


def test_a_finished_stage_is_reused_with_the_same_settings(tmp_path):
    config = toy_config(tmp_path)
    start = begin_stage(TOY, config)
    assert start.reused is None and read_record(start.output)["status"] == "started"
    ckpt = finish_with_checkpoint(start)
    again = begin_stage(TOY, config)
    assert again.reused["artifacts"]["checkpoint"]["uri"] == str(ckpt)
    assert again.reused["metrics"] == {"steps": 1} and "rows" not in again.reused  # big extras stay out
    assert again.moved == []


def test_other_settings_are_refused_naming_each_field_and_the_ways_out(tmp_path):
    config = toy_config(tmp_path)
    finish_with_checkpoint(begin_stage(TOY, config))
    (tmp_path / "data.jsonl").write_text('{"messages": [1]}\n')
    changed = toy_config(tmp_path, "--lr", "0.5", "--lora-rank", "8")
    with pytest.raises(StageSettingsMismatch) as err:
        begin_stage(TOY, changed)
    message = str(err.value)
    assert "train.lr: 1e-06 -> 0.5" in message or "train.lr:" in message and "-> 0.5" in message
    assert "lora.lora_rank: (default) -> 8" in message
    assert f"input data: other content (changed in place: {tmp_path / 'data.jsonl'})" in message
    assert "a finished toy of run 'r'" in message and "--run-id r-2" in message and "--overwrite" in message
    assert (tmp_path / "out" / "iter_0000001").is_dir()  # nothing moved or lost


def test_overwrite_moves_the_earlier_output_and_record_aside(tmp_path):
    config = toy_config(tmp_path)
    finish_with_checkpoint(begin_stage(TOY, config))
    start = begin_stage(TOY, toy_config(tmp_path, "--lr", "0.5", "--overwrite"))
    assert start.reused is None and len(start.moved) == 2
    assert all(".replaced-" in m for m in start.moved) and not (tmp_path / "out").exists()
    aside = [p.name for p in tmp_path.iterdir() if ".replaced-" in p.name]
    assert any(name.startswith("out.replaced-") for name in aside)
    assert any(name.startswith(f"out{RECORD_SUFFIX}.replaced-") for name in aside)
    assert read_record(start.output)["settings"]["config"]["train.lr"] == 0.5


def test_an_input_the_run_committed_anew_upstream_runs_the_stage_again(tmp_path):
    """SFT re-ran (its checkpoint was corrupt): export of it is stale by the run's own doing, not refused."""
    upstream = tmp_path / "store" / "r" / "sft" / "checkpoint"
    committed_iteration(upstream, 1)
    config = toy_config(tmp_path, "--sft-data", str(upstream))
    finish_with_checkpoint(begin_stage(TOY, config))
    (upstream / "iter_0000001").rename(tmp_path / "corrupt-aside")
    committed_iteration(upstream, 1, b"retrain")
    start = begin_stage(TOY, config)
    assert start.reused is None and start.moved[0].startswith(str(tmp_path / "out.replaced-"))
    # the same change to an input outside the run directory is refused (test above), and so is a config change
    committed_iteration(upstream, 2, b"again")
    finish_with_checkpoint(start)
    with pytest.raises(StageSettingsMismatch):
        begin_stage(TOY, toy_config(tmp_path, "--sft-data", str(upstream), "--lr", "0.5"))


def test_an_output_with_no_record_is_not_reused(tmp_path):
    config = toy_config(tmp_path)
    committed_iteration(tmp_path / "out", 3)
    with pytest.raises(StageSettingsMismatch, match="no record of the settings"):
        begin_stage(TOY, config)
    assert begin_stage(TOY, config, overwrite=True).moved[0].startswith(str(tmp_path / "out.replaced-"))


def test_a_failed_early_attempt_with_other_settings_is_simply_started_over(tmp_path):
    begin_stage(TOY, toy_config(tmp_path, "--lr", "0.5"))  # started, then failed before committing anything
    start = begin_stage(TOY, toy_config(tmp_path))
    assert start.reused is None and read_record(start.output)["settings"]["config"]["train.lr"] != 0.5


def test_an_unfinished_attempt_with_checkpoints_and_other_settings_is_refused(tmp_path):
    start = begin_stage(TOY_RESUMABLE, toy_config(tmp_path, "--lr", "0.5"))
    committed_iteration(start.output, 2)
    with pytest.raises(StageSettingsMismatch, match="an unfinished toy"):
        begin_stage(TOY_RESUMABLE, toy_config(tmp_path))


def test_a_resumable_attempt_keeps_its_intact_checkpoints(tmp_path):
    config = toy_config(tmp_path)
    start = begin_stage(TOY_RESUMABLE, config)
    committed_iteration(start.output, 2)
    newest = committed_iteration(start.output, 4)
    (newest / "model.bin").write_bytes(b"wrecked")  # same size, other bytes: fails verification
    again = begin_stage(TOY_RESUMABLE, config)
    (moved,) = again.moved
    assert moved.startswith(f"{newest}.replaced-") and latest_checkpoint(start.output).endswith("iter_0000002")


def test_an_unfinished_attempt_of_a_stage_that_cannot_resume_starts_clean(tmp_path):
    config = toy_config(tmp_path)
    start = begin_stage(TOY, config)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "half-written").write_text("x")
    (aside,) = begin_stage(TOY, config).moved
    assert not (tmp_path / "out").exists() and (Path(aside) / "half-written").read_text() == "x"
    assert start.record_uri == str(tmp_path / "out") + RECORD_SUFFIX


def test_a_done_stage_whose_artifact_broke_runs_again(tmp_path):
    config = toy_config(tmp_path)
    ckpt = finish_with_checkpoint(begin_stage(TOY_RESUMABLE, config))
    (ckpt / "manifest.json").unlink()
    again = begin_stage(TOY_RESUMABLE, config)
    assert again.reused is None and read_record(again.output)["status"] == "started"


def test_an_unreadable_record_is_refused_by_name(tmp_path):
    config = toy_config(tmp_path)
    (tmp_path / f"out{RECORD_SUFFIX}").write_text("{not json")
    with pytest.raises(StageSettingsMismatch, match="unreadable"):
        begin_stage(TOY, config)


# ----------------------------------------------------------------- the real definitions


@pytest.fixture
def sft_config(tiny_kit, tmp_path):
    def make(*extra):
        return load_config(str(TINY_CPU), ["--run-id", "r", "--store", str(tmp_path / "store"),
                                           "--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", str(tiny_kit.sft),
                                           "--save", str(tmp_path / "store" / "r" / "sft" / "checkpoint"), *extra])
    return make


@pytest.mark.parametrize(("change", "field"), [
    (["--lora-rank", "64", "--lora-alpha", "128", "--target-modules", "all-linear"], "lora.lora_rank"),
    (["--sft-lr", "0.002"], "sft.sft_lr"),
    (["--calculate-per-token-loss"], "algorithm.calculate_per_token_loss"),
    (["--sft-data", "OTHER"], "input sft_data"),
])
def test_sft_refuses_a_finished_checkpoint_of_other_settings(sft_config, tiny_kit, tmp_path, change, field):
    """docs/lora.md's LoRA SFT on a run that holds a full fine-tune: refused, not 'nothing to do'."""
    start = begin_stage(SFT, sft_config())
    finish_with_checkpoint(start, 372)
    if change[-1] == "OTHER":
        change = ["--sft-data", f"{tiny_kit.sft}@[0:64]"]
    with pytest.raises(StageSettingsMismatch, match=field.replace(".", r"\.")):
        begin_stage(SFT, sft_config(*change))
    # what does not change the artifact does not refuse: a save interval only adds checkpoints
    assert begin_stage(SFT, sft_config("--sft-save-interval", "7")).reused is not None


def test_sft_settings_are_the_same_for_a_checkpoint_root_and_its_iteration(sft_config, tmp_path):
    """`slime sft --load RUN/convert/checkpoint` and the pipeline's `.../iter_0000000` are one input."""
    root = tmp_path / "store" / "r" / "convert" / "checkpoint"
    ckpt = committed_iteration(root, 0)
    by_root, by_iteration = SFT.settings(sft_config("--load", str(root))), SFT.settings(sft_config("--load", str(ckpt)))
    assert by_root["inputs"]["load"]["uri"] != by_iteration["inputs"]["load"]["uri"]
    assert same_settings(by_root, by_iteration)
    # the pipeline hands SFT its schedule as `train` (flows/sft.py); the CLI leaves it in sft_*
    via_cli = sft_config("--sft-lr", "0.003")
    via_flow = via_cli.model_copy(update={"train": via_cli.sft_train()})
    assert same_settings(SFT.settings(via_cli), SFT.settings(via_flow))


def test_rl_refuses_another_loss_and_schedule_before_anything_starts(sft_config, tmp_path):
    config = sft_config("--save", str(tmp_path / "store" / "r" / "rl" / "checkpoint"))
    start = begin_stage(RL, config)
    committed_iteration(start.output, 3)
    with pytest.raises(StageSettingsMismatch) as err:
        begin_stage(RL, sft_config("--save", start.output, "--num-rollout", "8", "--advantage-estimator", "gspo"))
    assert "rollout.num_rollout" in str(err.value) and "algorithm.advantage_estimator" in str(err.value)
    record = json.loads(Path(start.record_uri).read_text())
    assert record["status"] == "started" and record["stage"] == "rl"


def test_rl_continues_on_more_iterations_but_not_on_fewer(sft_config, tmp_path):
    """`--num-rollout` raised on a finished RL run continues it from its newest checkpoint (docs/ray.md's
    multi-node resume); lowered, or raised together with another change, it is refused."""
    save = str(tmp_path / "store" / "r" / "rl" / "checkpoint")
    start = begin_stage(RL, sft_config("--save", save, "--num-rollout", "2"))
    finish_with_checkpoint(start, 1)
    more = begin_stage(RL, sft_config("--save", save, "--num-rollout", "3"))
    assert more.reused is None and more.moved == [] and latest_checkpoint(save).endswith("iter_0000001")
    assert read_record(save)["status"] == "started"
    assert read_record(save)["settings"]["config"]["rollout"]["num_rollout"] == 3
    with pytest.raises(StageSettingsMismatch, match=r"rollout\.num_rollout: 3 -> 1"):
        begin_stage(RL, sft_config("--save", save, "--num-rollout", "1"))
    with pytest.raises(StageSettingsMismatch, match="algorithm.advantage_estimator"):
        begin_stage(RL, sft_config("--save", save, "--num-rollout", "4", "--advantage-estimator", "gspo"))


def test_another_artifact_of_the_run_as_input_is_not_an_upstream_renewal(tmp_path):
    """SFT on the run's accepted rejection-sampling set where it trained on the kit's data: other data."""
    config = toy_config(tmp_path)
    finish_with_checkpoint(begin_stage(TOY, config))
    accepted = tmp_path / "store" / "r" / "rejection_sampling" / "accepted"
    accepted.mkdir(parents=True)
    (accepted / "shard.arrow").write_bytes(b"rows")
    commit_directory(str(accepted), "shards")
    with pytest.raises(StageSettingsMismatch, match="input data: other content"):
        begin_stage(TOY, toy_config(tmp_path, "--sft-data", str(accepted)))
