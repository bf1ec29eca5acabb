"""Deployments of prefect.yaml on a real `prefect server` with a `slime-local` process worker (slow).

1. `prefect deployment run 'post-training/tiny-cpu' --watch` of the tiny pipeline that fails at export,
   then `prefect flow-run retry` after the fix, which completes with convert and sft Cached (~4 min).
2. `evaluate/evaluate-newest` with an interval schedule: runs created by the server's scheduler (not by
   `deployment run`) evaluate the watched run's newest committed checkpoint once, then skip (~8 min).
"""

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prefect_server import PREFECT, ROOT, PrefectServer, prefect_server, stop, tail

from flows.pipeline import OPTIONAL  # left out here: this test is about the deployment, not the stages
from slime.storage import ArtifactStore, read_manifest
from tasks._report import artifact_key

TINY_CPU = "deployments/tiny-cpu.yaml"
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def cli(server: PrefectServer, *args: str, worker_log: Path, timeout: float = 300, expect: int = 0) -> str:
    """`prefect ARGS` against the server from the project root; asserts the exit code, returns stdout."""
    done = subprocess.run([PREFECT, *args], cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == expect, (f"prefect {' '.join(args)}: exit {done.returncode}\n{done.stdout[-3000:]}\n"
                                       f"{done.stderr[-3000:]}\nworker log:\n{tail(worker_log)}")
    return done.stdout


@contextlib.contextmanager
def worker(server: PrefectServer, log_path: Path):
    """`prefect worker start --pool slime-local` from the project root (the pull step's $PWD), stopped by PID."""
    with open(log_path, "w") as log:
        process = subprocess.Popen([PREFECT, "worker", "start", "--pool", "slime-local"], cwd=ROOT, env=server.env,
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            stop(process)


@pytest.mark.slow
def test_deployment_run_of_the_tiny_pipeline_exits_0(tiny_kit, tmp_path):
    worker_log = tmp_path / "worker.log"
    with prefect_server(tmp_path) as server:
        cli(server, "work-pool", "create", "slime-local", "--type", "process", worker_log=worker_log)
        assert "post-training/tiny-cpu" in cli(server, "deploy", "--all", "--no-prompt", worker_log=worker_log)
        with worker(server, worker_log):
            origin, store = tmp_path / "origin", tmp_path / "store"
            overrides = ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]",
                         "--sft-num-epoch", "1", "--origin-hf-dir", str(origin)]
            # 1. a deployment run whose export fails: its origin HF directory describes another architecture
            # (half the MLP width), which the checkpoint does not fit; --watch exits 1. (A missing origin
            # directory fails before any stage runs: slime.preflight.)
            shutil.copytree(tiny_kit.model_dir, origin)
            hf_config = json.loads((origin / "config.json").read_text())
            hf_config["intermediate_size"] //= 2
            (origin / "config.json").write_text(json.dumps(hf_config))
            cli(server, "deployment", "run", "post-training/tiny-cpu", "--watch",
                "--param", f"overrides={json.dumps(overrides)}", "--param", f"store={json.dumps(str(store))}",
                "--param", 'run_id="deployed"', "--param", f"skip={json.dumps(list(OPTIONAL))}",
                worker_log=worker_log, timeout=480, expect=1)
            sft_manifest = store / "deployed" / "sft" / "checkpoint" / "iter_0000001" / "manifest.json"
            committed_at = json.loads(sft_manifest.read_text())["created_at"]

            # 2. fixed, then `prefect flow-run retry`: the worker runs it again and it continues at export
            shutil.rmtree(origin)
            shutil.copytree(tiny_kit.model_dir, origin)
            cli(server, "flow-run", "retry", "post-training-deployed", worker_log=worker_log)
            deadline = time.monotonic() + 300
            while True:
                (run,) = server.api("flow_runs/filter", {"flow_runs": {"name": {"any_": ["post-training-deployed"]}}})
                if run["state_type"] in TERMINAL:
                    break
                assert time.monotonic() < deadline, f"retry still {run['state_type']}:\n{tail(worker_log)}"
                time.sleep(3)
        assert run["state_type"] == "COMPLETED", tail(worker_log)
        assert ArtifactStore(str(store)).committed("deployed", "export") == ["hf"]
        assert json.loads(sft_manifest.read_text())["created_at"] == committed_at  # sft was not run again
        states = {}
        for task_run in server.api("task_runs/filter", {"task_runs": {"name": {"any_": [
                "convert-deployed", "sft-deployed", "export-deployed"]}}}):
            states.setdefault(task_run["name"], []).append(task_run["state_name"])
    assert sorted(states["sft-deployed"]) == ["Cached", "Completed"]
    assert sorted(states["convert-deployed"]) == ["Cached", "Completed"]
    assert sorted(states["export-deployed"]) == ["Completed", "Failed"]


# ----------------------------------------------------------------------------- scheduled eval


def slime_stage(*args: str, log: Path) -> None:
    """`python -m slime ARGS` (no Prefect) from the project root; asserts it succeeded."""
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, "-m", "slime", *args], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, timeout=600)
    assert done.returncode == 0, f"slime {args[0]} failed:\n{tail(log)}"


def commit_checkpoints(kit, store: Path, run: str, log: Path) -> Path:
    """A watched run with a committed convert checkpoint and a newer SFT one; returns the SFT iteration."""
    common = ["--config", TINY_CPU, "--hf-checkpoint", str(kit.model_dir)]
    slime_stage("convert", *common, "--save", str(store / run / "convert" / "checkpoint"), log=log)
    slime_stage("sft", *common, "--load", str(store / run / "convert" / "checkpoint"),
                "--save", str(store / run / "sft" / "checkpoint"), "--sft-data", f"{kit.sft}@[0:16]",
                "--sft-num-epoch", "1", log=log)
    (newest,) = sorted((store / run / "sft" / "checkpoint").glob("iter_*"))
    return newest


def finished_runs(server: PrefectServer, deployment_id: str) -> list[dict]:
    runs = server.api("flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment_id]}},
                                           "sort": "EXPECTED_START_TIME_ASC"})
    return [run for run in runs if run["state_type"] in TERMINAL]


def run_logs(server: PrefectServer, flow_run_id: str) -> str:
    logs = server.api("logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})
    return "\n".join(entry["message"] for entry in logs)


@pytest.mark.slow
def test_scheduled_eval_evaluates_the_newest_checkpoint_once(tiny_kit, tmp_path, monkeypatch):
    # the server's scheduler looks for due schedules every 5 s instead of 60 (the test waits less)
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS", "5")
    store, watched, worker_log = tmp_path / "store", "watched", tmp_path / "worker.log"
    prepared: dict[str, Path] = {}
    preparing = threading.Thread(target=lambda: prepared.update(
        sft=commit_checkpoints(tiny_kit, store, watched, tmp_path / "stages.log")))
    preparing.start()  # convert + sft (~1.5 min) while the server starts
    try:
        with prefect_server(tmp_path) as server:
            cli(server, "work-pool", "create", "slime-local", "--type", "process", worker_log=worker_log)
            cli(server, "concurrency-limit", "create", "slime-gpu", "1", worker_log=worker_log)
            overrides = ["--hf-checkpoint", str(tiny_kit.model_dir), "--prompt-data", str(tiny_kit.train),
                         "--sft-data", str(tiny_kit.sft), "--rs-prompt-data", f"{tiny_kit.train}@[0:4]",
                         "--eval-prompt-data", "arithmetic", f"{tiny_kit.eval}@[0:4]"]
            params = {"overrides": overrides, "store": str(store), "eval_watch_run": watched}
            # the deployment as prefect.yaml declares it (entrypoint, cron, concurrency limit, tags), with
            # this test's store and data
            cli(server, "deploy", "--name", "evaluate-newest", "--params", json.dumps(params), "--no-prompt",
                worker_log=worker_log)
            deployment = httpx.get(f"{server.url}/api/deployments/name/evaluate/evaluate-newest", timeout=30).json()
            assert [s["schedule"].get("cron") for s in deployment["schedules"]] == ["*/30 * * * *"]
            assert deployment["global_concurrency_limit"]["limit"] == 1  # prefect.yaml's concurrency_limit
            assert deployment["parameters"]["eval_watch_run"] == watched and "slime" in deployment["tags"]
            preparing.join(timeout=600)
            assert "sft" in prepared, f"preparing the watched run failed:\n{tail(tmp_path / 'stages.log')}"
            # every minute instead of every 30: the scheduler creates the runs; the worker executes them
            cli(server, "deployment", "schedule", "create", "evaluate/evaluate-newest", "--interval", "60",
                "--replace", "-y", worker_log=worker_log)
            with worker(server, worker_log):
                deadline = time.monotonic() + 900
                while len(runs := finished_runs(server, deployment["id"])) < 2:
                    assert time.monotonic() < deadline, f"{len(runs)} scheduled run(s) finished:\n{tail(worker_log)}"
                    time.sleep(5)
            first, second = runs[:2]
            logs = [run_logs(server, run["id"]) for run in (first, second)]
            artifacts = [server.api("artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
                         for run in (first, second)]
    finally:
        preparing.join(timeout=600)

    for run in (first, second):
        assert run["state_type"] == "COMPLETED", f"{run['name']}: {run['state_name']}\n{tail(worker_log)}"
        assert run["auto_scheduled"] is True  # created by the scheduler, not by `deployment run`
        assert run["name"] == f"evaluate-{watched}"
    # the first evaluated the SFT checkpoint (newer than convert's), and its results artifact names it
    sft = str(prepared["sft"])
    (table,) = [a for a in artifacts[0] if a["key"] == artifact_key(watched, "evaluate", "results")]
    rows = json.loads(table["data"])
    assert {row["checkpoint"] for row in rows} == {sft} and [row["dataset"] for row in rows] == ["arithmetic"]
    (result,) = ArtifactStore(str(store)).committed(watched, "evaluate")
    meta = read_manifest(str(store / watched / "evaluate" / result)).metadata
    assert meta["checkpoint"] == sft and set(meta["metrics"]) == {"arithmetic"}
    assert result.startswith("sft-iter_0000001-")
    # the second found nothing new: skipped without an eval or an artifact
    assert "evaluate: skipped" in logs[1] and f"{sft} was evaluated with this config already" in logs[1], logs[1]
    assert artifacts[1] == []
