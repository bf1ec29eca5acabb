"""How a stage flow resolves its run (no Prefect API needed)."""

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
    data = yaml.safe_load(TINY_CPU.read_text())
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
