"""Issue 5's promise, end to end: `python -m slime.rl` (the same as `slime rl`) is killed with SIGKILL
right after its first committed checkpoint; nothing it started outlives it; the same command again
resumes at the next step (no step run twice) and ends with the weights, bit for bit, and the last
step's metrics of an uninterrupted run of the same config and seed (CPU, fp32, tiny kit, GRPO).

Why bit-equality holds: every sample is generated with its own `sampling_seed` (from `rollout_seed` and
the sample's ids), so the restarted engine draws the tokens the uninterrupted run's engine drew; the
checkpoint restores weights, optimizer, scheduler, RNG and the data-source cursor; one train rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))  # rl_setup (plugins for the subprocess)

from rl_setup import rl_config  # noqa: E402

from slime.backends.megatron.checkpoint import latest_checkpoint, read_training_state  # noqa: E402
from slime.rl.metrics import outcome, outcome_differences, read_metrics  # noqa: E402

NUM_ROLLOUT = 3
PLUGINS = str(Path(__file__).resolve().parents[1] / "ray")
RUN_TIMEOUT_S = 600
# Ray's dashboard and runtime-env agents notice their dead raylet on their own, within about a minute
AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def write_config(tiny_kit, root: Path, run_id: str) -> tuple[Path, str]:
    """GRPO 2 prompts x 4 samples, one rank, one engine, 3 rollouts, a checkpoint after each, evals at
    weight versions 0, 2 and 3; the YAML file and the checkpoint directory."""
    config = rl_config(tiny_kit, root / run_id, run_id, actor_num_gpus_per_node=1, rollout_num_gpus=1)
    config.run.store = str(root / "store")
    config.rollout.num_rollout = NUM_ROLLOUT
    config.checkpoint.save_interval = 1
    config.eval.eval_interval = 2
    path = root / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path, config.checkpoint.save


def command(config_file: Path) -> list[str]:
    return [sys.executable, "-m", "slime.rl", "--config", str(config_file)]


def spawn(config_file: Path, log: Path) -> subprocess.Popen:
    """The command in the background, stderr appended to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(command(config_file), env={**os.environ, "PYTHONPATH": PLUGINS},
                                stdout=subprocess.DEVNULL, stderr=out)


def run_to_end(config_file: Path, log: Path) -> dict:
    """The command to its end (exit 0); its JSON summary."""
    with open(log, "ab") as out:
        done = subprocess.run(command(config_file), env={**os.environ, "PYTHONPATH": PLUGINS}, stdout=subprocess.PIPE,
                              stderr=out, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, log.read_text()[-3000:]
    text = done.stdout.decode()
    return json.loads(text[text.index("{"):])


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:160]}"
    except psutil.Error:
        return f"{proc.pid} (gone)"


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def model_weights(checkpoint: str, scratch: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a torch_dist checkpoint, read with torch's own DCP reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{Path(checkpoint).parent.parent.name}-{Path(checkpoint).name}.pt"
    dcp_to_torch_save(f"{checkpoint}/model", target)
    state = torch.load(target, weights_only=True)
    return {k: v for k, v in state.items() if "_extra_state" not in k}


def metric_lines(uri: str) -> list[int]:
    """The rollout id of every line of a metrics log, in order (a repeated step would appear twice)."""
    if not Path(uri).exists():  # killed before its first line
        return []
    return [json.loads(line)["rollout_id"] for line in Path(uri).read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_resumes_to_the_uninterrupted_weights(tiny_kit, tmp_path):
    reference_file, reference_save = write_config(tiny_kit, tmp_path, "uninterrupted")
    reference = run_to_end(reference_file, tmp_path / "uninterrupted.log")
    assert [s["rollout_id"] for s in reference["steps"]] == [0, 1, 2]

    config_file, save = write_config(tiny_kit, tmp_path, "killed")
    log = tmp_path / "killed.log"
    started: list[psutil.Process] = []
    ray_dirs: set[str] = set()
    child = spawn(config_file, log)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while latest_checkpoint(save) is None:  # a checkpoint exists only once its manifest is committed
            assert child.poll() is None, f"exited {child.returncode} before a checkpoint: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.2)
        # everything the run started, recorded before the kill: Ray's processes, workers, engine, router
        started = psutil.Process(child.pid).children(recursive=True)
        for proc in started:
            with contextlib.suppress(psutil.Error):
                ray_dirs |= set(re.findall(r"/tmp/slime-ray-[^/\s]+", " ".join(proc.cmdline())))
        names = " ".join(describe(p) for p in started)  # before the kill: a dead process has no command line
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
        assert "slime.engines.builtin" in names and "router" in names and "TrainActor" in names, names
        assert len(ray_dirs) == 1, ray_dirs  # the run's private Ray temp dir

        # the engine, the router, the train and rollout actors and Ray itself die with the driver
        left = wait_gone([p for p in started if not any(a in describe(p) for a in AGENTS)], 60)
        assert not left, [describe(p) for p in left]
        killed_at = int(latest_checkpoint(save).rsplit("_", 1)[1])
        assert killed_at < NUM_ROLLOUT - 1  # killed mid-run: there is something to resume
        before = metric_lines(f"{tmp_path}/store/killed/rl/metrics.jsonl")

        resumed = run_to_end(config_file, log)
        assert not wait_gone(started, 90), [describe(p) for p in started if alive(p)]  # the agents too
    finally:
        if child.poll() is None:
            child.kill()
        for proc in started:  # only what the killed run started, by PID, if the test failed early
            if alive(proc):
                proc.kill()
        for path in ray_dirs:  # SIGKILL left the run no chance to remove its Ray temp dir
            shutil.rmtree(path, ignore_errors=True)

    # resumed at the next step; every step logged exactly once over both runs (the checkpoint's own step,
    # when the kill came between its save and its metrics line, is finished by the rerun's set-up)
    assert resumed["resumed"] and resumed["start_rollout_id"] == killed_at + 1
    assert [s["rollout_id"] for s in resumed["steps"]] == list(range(killed_at + 1, NUM_ROLLOUT))
    lines = metric_lines(resumed["metrics_uri"])
    finished = [] if killed_at in before else [killed_at]
    assert lines == before + finished + list(range(killed_at + 1, NUM_ROLLOUT)), (before, lines)
    assert sorted(lines) == list(range(NUM_ROLLOUT))

    # the same final checkpoint, data-source state, weights and last-step results as the uninterrupted run
    final, reference_final = resumed["last_checkpoint"], reference["last_checkpoint"]
    assert final == f"{save}/iter_{NUM_ROLLOUT - 1:07d}" and reference_final == f"{reference_save}/iter_0000002"
    state, reference_state = read_training_state(final), read_training_state(reference_final)
    assert state.extra_state["data_source"] == reference_state.extra_state["data_source"]
    weights, reference_weights = model_weights(final, tmp_path), model_weights(reference_final, tmp_path)
    assert weights.keys() == reference_weights.keys() and len(weights) > 5
    for name, tensor in reference_weights.items():
        assert torch.equal(weights[name], tensor), name
    records, reference_records = read_metrics(resumed["metrics_uri"]), read_metrics(reference["metrics_uri"])
    assert "rl/grad_norm" in outcome(records[2]) and "eval/tiny/mean_reward" in outcome(records[2])
    for rollout_id in range(NUM_ROLLOUT):  # every step's results, the last one's above all
        assert outcome_differences(records[rollout_id], reference_records[rollout_id]) == [], rollout_id
