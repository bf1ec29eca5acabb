"""Runs never collide (slow, two `slime rl` processes on the tiny kit): a second writer on a run id is refused
naming the first, and two runs with different `--store` in one working directory write only into their stores
(the checkpoint directory follows the store: the second run starts at rollout 0, it does not resume the first)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))  # rl_setup (plugins for the subprocess)

from rl_setup import rl_config  # noqa: E402

from slime.cli import main  # noqa: E402
from slime.rl.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = str(Path(__file__).resolve().parents[1] / "ray")
RUN_TIMEOUT_S = 600


def slime_rl(config_file: Path, cwd: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), PLUGINS])}
    return subprocess.Popen([sys.executable, "-m", "slime", "rl", "--config", str(config_file), *flags], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def summary(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == 0, err[-4000:]
    return json.loads(out[out.index("{"):])


@pytest.mark.slow
def test_one_writer_per_run_and_separate_stores_share_nothing(tiny_kit, tmp_path, capsys):
    work, conf = tmp_path / "work", tmp_path / "conf"
    work.mkdir()
    conf.mkdir()
    config = rl_config(tiny_kit, tmp_path, "exp", actor_num_gpus_per_node=1, rollout_num_gpus=1)
    config.checkpoint.save = None  # as deployments/tiny-cpu.yaml: checkpoints go to {store}/{run_id}/rl/checkpoint
    config.checkpoint.save_interval = 1
    config.rollout.num_rollout = 2
    config_file = conf / "rl.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))

    # 1. slime rl --store A; while it runs, a second slime rl on the same run is refused, naming the first
    first = slime_rl(config_file, work, "--store", "A")
    lease = work / "A" / "exp" / ".lease.json"
    deadline = time.monotonic() + 120
    while not lease.exists():
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first run took no lease"
        time.sleep(0.2)
    assert main(["rl", "--config", str(config_file), "--store", str(work / "A")]) == 2
    err = capsys.readouterr().err
    assert f"is in use by python -m slime rl --config {config_file} --store A" in err
    assert f"pid {first.pid}" in err and "one writer per run" in err and "Traceback" not in err
    a = summary(first)
    assert a["start_rollout_id"] == 0 and a["num_rollout"] == 2
    assert not lease.exists()

    # 2. slime rl --store B --num-rollout 1 in the same working directory: its own checkpoints, from rollout 0
    b = summary(slime_rl(config_file, work, "--store", "B", "--num-rollout", "1"))
    assert b["start_rollout_id"] == 0 and b["resumed"] is False
    assert b["last_checkpoint"] == str(work / "B" / "exp" / "rl" / "checkpoint" / "iter_0000000")
    assert sorted(p.name for p in (work / "A" / "exp" / "rl" / "checkpoint").iterdir() if p.is_dir()) == [
        "iter_0000000", "iter_0000001"]
    assert sorted(p.name for p in (work / "B" / "exp" / "rl" / "checkpoint").iterdir() if p.is_dir()) == [
        "iter_0000000"]
    assert sorted(read_metrics(str(work / "B" / "exp" / "rl" / "metrics.jsonl"))) == [0]
    assert (work / "B" / "exp" / "rl" / "logs" / "router.log").is_file()  # engine logs with the run
    assert sorted(p.name for p in work.iterdir()) == ["A", "B"]  # nothing else in the working directory
    assert sorted(p.name for p in conf.iterdir()) == ["rl.yaml"]
