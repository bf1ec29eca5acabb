"""How a stage flow resolves its run, and the pipeline's stage table and summary (no Prefect API needed)."""

import re
from pathlib import Path

import pytest
import yaml

from flows._stage import newest_model, output_uri, resolve_run
from slime.errors import NotCommittedError
from slime.storage import commit_directory

TINY_CPU = Path(__file__).resolve().parents[2] / "deployments" / "tiny-cpu.yaml"


@pytest.fixture
def config_without_run_id(tmp_path):
    # a copy elsewhere: its paths relative to deployments/ made absolute
    data = yaml.safe_load(TINY_CPU.read_text().replace("../", f"{TINY_CPU.parents[1]}/"))
    del data["run"]["run_id"]
    path = tmp_path / "no-run-id.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_run_id_comes_from_the_parameter_then_the_config_then_the_start_time(config_without_run_id, tmp_path):
    config, run_id = resolve_run(str(TINY_CPU), ["--sft-num-epoch", "1"], str(tmp_path), None)
    assert run_id == "tiny-cpu" and config.run.store == str(tmp_path) and config.sft.sft_num_epoch == 1
    assert resolve_run(str(TINY_CPU), None, None, "mine")[1] == "mine"
    config, run_id = resolve_run(config_without_run_id, None, None, None)
    assert re.fullmatch(r"run-\d{8}-\d{6}", run_id) and config.run.run_id == run_id
    assert output_uri(config, run_id, "sft", "checkpoint").endswith(f"/runs/{run_id}/sft/checkpoint")


def test_a_stage_run_alone_takes_the_newest_committed_upstream_checkpoint(tmp_path):
    config, _ = resolve_run(str(TINY_CPU), None, str(tmp_path), "r")
    with pytest.raises(NotCommittedError, match="no committed checkpoint from sft or convert"):
        newest_model(config, "r", ("sft", "convert"))
    for stage, step in (("convert", 0), ("sft", 4), ("sft", 8)):
        path = tmp_path / "r" / stage / "checkpoint" / f"iter_{step:07d}"
        path.mkdir(parents=True)
        (path / "w").write_text(stage)
        commit_directory(str(path), "checkpoint")
    (tmp_path / "r" / "sft" / "checkpoint" / "iter_0000012").mkdir()  # uncommitted: not a checkpoint yet
    assert newest_model(config, "r", ("sft", "convert")) == str(tmp_path / "r" / "sft" / "checkpoint" / "iter_0000008")
    assert newest_model(config, "r", ("convert",)).endswith("/r/convert/checkpoint/iter_0000000")


def test_pipeline_summary_lists_skipped_stages_eval_accuracy_per_checkpoint_and_the_export():
    from flows.pipeline import describe, stage_rows

    def stage(uri, **metrics):
        return {"status": "ran", "artifacts": {"checkpoint": {"uri": uri, "manifest_hash": "0" * 64}},
                "seconds": {"x": 1.25}, "metrics": metrics}

    sft_eval = stage("/s/ev-sft", checkpoint="/s/sft/iter_1", datasets={"arith": {"mean_reward": 0.25, "pass@1": 0.25}})
    results = {"convert": stage("/s/convert"), "sft": stage("/s/sft/iter_1"),
               "evaluate": {**stage("/s/ev-rl", checkpoint="/s/rl/iter_3",
                                    datasets={"arith": {"mean_reward": 0.5, "pass@1": 0.5, "truncated_ratio": 0.1}}),
                            "compared": [sft_eval]},
               "export": {**stage("/s/hf"), "artifacts": {"hf_model": {"uri": "/s/hf", "manifest_hash": "1" * 64}}}}
    rows = {r["stage"]: r for r in stage_rows(results, ["rejection_sampling", "rl"])}
    assert rows["rl"]["status"] == "skipped" and rows["sft"]["seconds"] == 1.25
    assert stage_rows(results)[3]["status"] == "not completed"
    text = describe(results)
    assert "after SFT            arith: mean_reward 0.2500, pass@1 0.2500   /s/sft/iter_1" in text
    assert "arith: mean_reward 0.5000, pass@1 0.5000   /s/rl/iter_3" in text and "truncated" not in text
    assert text.index("after SFT ") < text.index("/s/rl/iter_3")
    assert "exported HF model: /s/hf" in text
