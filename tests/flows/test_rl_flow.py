"""The `rl` flow on the tiny kit through a real Prefect API: per-step task runs named by iteration over
one RLLoop, the progress / metrics-table / report artifacts, and a failed run that resumes from its
newest committed RL checkpoint (not from iteration 0), then is reused (Cached) unchanged; the
scheduled eval (`eval_watch_run`) evaluates its newest checkpoint once and then skips."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName

from flows.evaluate import evaluate_flow
from flows.rl import CURVE_NAME, rl_flow
from slime.backends.megatron.checkpoint import latest_checkpoint
from slime.rl import read_metrics
from tasks._report import artifact_key
from tasks.convert import convert

TINY_CPU = Path(__file__).resolve().parents[2] / "deployments" / "tiny-cpu.yaml"


def test_rl_flow_runs_steps_as_tasks_publishes_artifacts_and_resumes(prefect_api, tiny_kit, tmp_path, failing_train):
    store = tmp_path / "store"
    # every data path at the session's kit: tiny-cpu.yaml's own point at runs/tiny-kit, which make run builds
    overrides = ["--hf-checkpoint", str(tiny_kit.model_dir), "--prompt-data", str(tiny_kit.train), "--num-rollout", "2", "--rollout-batch-size", "2",
                 "--global-batch-size", "8", "--micro-batch-size", "4", "--save-interval", "1",
                 "--eval-interval", "2", "--eval-prompt-data", "arithmetic", f"{tiny_kit.eval}@[0:4]",
                 "--ci-test"]  # slime's invariants: a run whose engines or KL drift fails here
    from slime.config import load_config

    config = load_config(str(TINY_CPU), overrides)
    start = convert.fn(config, "t", {"hf_checkpoint": str(tiny_kit.model_dir)},
                       str(store / "t" / "convert" / "checkpoint"))["artifacts"]["checkpoint"]["uri"]
    params = {"config": str(TINY_CPU), "overrides": overrides, "store": str(store), "run_id": "t", "model": start}

    # 1. iteration 1 fails in training (after iteration 0 was checkpointed): the flow fails
    with pytest.raises(RuntimeError, match="injected failure in train"):
        rl_flow(**params)
    assert failing_train.failures == 1
    failing_train.armed = False
    save = store / "t" / "rl" / "checkpoint"
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000000"]

    # 2. the same parameters again: RL resumes at iteration 1 from that checkpoint
    state = rl_flow(**params, return_state=True)
    result = state.result()
    assert result["status"] == "ran" and result["metrics"]["resumed"] is True
    assert result["metrics"]["start_rollout_id"] == 1 and result["metrics"]["iterations_run"] == 1
    assert result["artifacts"]["checkpoint"]["uri"] == str(save / "iter_0000001")
    assert sorted(read_metrics(result["metrics"]["metrics_uri"])) == [0, 1]
    assert [r["iteration"] for r in result["rows"]] == [0, 1] and result["rows"][1]["prefect_s"] >= 0
    assert (store / "t" / "rl" / CURVE_NAME).read_bytes()[:4] == b"\x89PNG"

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        assert flow_run.name == "rl-t"
        names = {t.name for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
            any_=[flow_run.id])))}
        assert {"rl-t", "rollout-0001", "train-0001", "save-0001", "sync-0001", "eval-0001"} <= names
        assert "rollout-0000" not in names  # done by the failed run, not redone
        failed = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["train-0001"])))
        assert {t.state.type.value for t in failed} == {"FAILED", "COMPLETED"}
    progress = Artifact.get(artifact_key("t", "rl", "progress"))
    assert progress.type == "progress" and float(progress.data) == 100.0
    table = Artifact.get(artifact_key("t", "rl", "metrics"))
    assert table.type == "table" and '"iteration": 1' in table.data and "reward_mean" in table.data
    report = Artifact.get(artifact_key("t", "rl", "report")).data
    assert "Reward per iteration" in report and "data:image/png;base64," in report and str(save) in report

    # 3. unchanged: reused from the store, nothing recomputed
    again = rl_flow(**params)
    assert again["status"] == "cached" and again["artifacts"] == result["artifacts"]

    # 4. the scheduled eval: the newest committed checkpoint of run t, then nothing new, then a run without any
    watch = {"config": str(TINY_CPU), "overrides": overrides, "store": str(store)}
    evaluated = evaluate_flow(**watch, eval_watch_run="t")
    assert evaluated["status"] == "ran" and evaluated["metrics"]["checkpoint"] == str(save / "iter_0000001")
    assert evaluate_flow(**watch, eval_watch_run="t")["status"] == "skipped"
    nothing = evaluate_flow(**watch, eval_watch_run="empty")
    assert nothing["status"] == "skipped" and "no committed checkpoint" in nothing["reason"]


def descendants_alive(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            continue
    return alive


@pytest.mark.slow
def test_sigterm_during_rl_stops_the_flow_cleanly_and_the_rerun_resumes(tiny_kit, tmp_path):
    """`python -m flows.rl` as an operator runs it (own ephemeral Prefect API) gets SIGTERM once RL has a
    checkpoint: it exits 143 and leaves nothing running (ray.init's own handler used to abort the process
    and leave the Prefect API server behind); the same command then resumes RL after that checkpoint."""
    store = tmp_path / "store"
    overrides = ["--hf-checkpoint", str(tiny_kit.model_dir), "--prompt-data", str(tiny_kit.train), "--num-rollout", "4",
                 "--rollout-batch-size", "2", "--global-batch-size", "8", "--micro-batch-size", "4",
                 "--save-interval", "1", "--eval-prompt-data", "arithmetic", f"{tiny_kit.eval}@[0:4]"]
    from slime.config import load_config

    convert.fn(load_config(str(TINY_CPU), overrides), "t", {"hf_checkpoint": str(tiny_kit.model_dir)},
               str(store / "t" / "convert" / "checkpoint"))  # the flow starts from the run's newest checkpoint
    command = [sys.executable, "-m", "flows.rl", "--config", str(TINY_CPU), "--store", str(store), "--run-id", "t",
               *overrides]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"})
    root = Path(__file__).resolve().parents[2]
    save = str(store / "t" / "rl" / "checkpoint")
    log = tmp_path / "flow.log"
    started: list[psutil.Process] = []
    with open(log, "ab") as out:
        child = subprocess.Popen(command, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while latest_checkpoint(save) is None:
            assert child.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no RL checkpoint in time"
            time.sleep(0.5)
        started = psutil.Process(child.pid).children(recursive=True)  # API server, Ray, actors, engine, router
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=300) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        deadline = time.monotonic() + 90
        while descendants_alive(started) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not descendants_alive(started)
        assert "Crashed" in log.read_text()  # Prefect recorded the interrupted runs
    finally:
        if child.poll() is None:
            child.kill()
        for proc in started:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    stopped_at = int(latest_checkpoint(save).rsplit("_", 1)[1])
    assert stopped_at < 3

    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()  # the JSON result (indented: "{" and "}" alone on their lines)
    result = json.loads("\n".join(lines[lines.index("{"):lines.index("}") + 1]))
    assert result["status"] == "ran" and result["metrics"]["resumed"] is True
    assert result["metrics"]["start_rollout_id"] == stopped_at + 1
    assert sorted(read_metrics(result["metrics"]["metrics_uri"])) == [0, 1, 2, 3]
