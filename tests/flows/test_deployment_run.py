"""A real `prefect server` + `slime-local` process worker + `prefect deploy --all`: a
`prefect deployment run 'post-training/tiny-cpu' --watch` of the tiny pipeline that fails at export,
then `prefect flow-run retry` after the fix, which completes with convert and sft Cached (slow: ~4 min)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flows.pipeline import OPTIONAL  # left out here: this test is about the deployment, not the stages
from slime.engines.process import find_free_port
from slime.storage import ArtifactStore

ROOT = Path(__file__).resolve().parents[2]
PREFECT = shutil.which("prefect", path=str(Path(sys.executable).parent))


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (what Prefect's server and worker shut down cleanly on), then SIGKILL; only our own PIDs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def read(path: Path) -> str:
    return path.read_text()[-4000:] if path.exists() else ""


@pytest.mark.slow
def test_deployment_run_of_the_tiny_pipeline_exits_0(tiny_kit, tmp_path):
    port = find_free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "1", "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PWD": str(ROOT)}
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("server", "worker")}  # noqa: SIM115
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                              env=env, stdout=logs["server"], stderr=subprocess.STDOUT)
    worker = None
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prefect server not healthy after 180 s"
            time.sleep(2)

        def prefect(*args, timeout=300, expect=0):
            done = subprocess.run([PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            assert done.returncode == expect, (f"prefect {' '.join(args)}: exit {done.returncode}\n{done.stdout[-3000:]}\n"
                                               f"{done.stderr[-3000:]}\nworker log:\n{read(tmp_path / 'worker.log')}")
            return done.stdout

        def api(path, body):
            return httpx.post(f"http://127.0.0.1:{port}/api/{path}", json={"offset": 0, "limit": 10, **body},
                              timeout=30).json()

        prefect("work-pool", "create", "slime-local", "--type", "process")
        assert "post-training/tiny-cpu" in prefect("deploy", "--all", "--no-prompt")
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "slime-local"], cwd=ROOT, env=env,
                                  stdout=logs["worker"], stderr=subprocess.STDOUT)
        origin, store = tmp_path / "origin", tmp_path / "store"
        overrides = ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]",
                     "--sft-num-epoch", "1", "--origin-hf-dir", str(origin)]
        # 1. a deployment run whose export fails (its origin HF directory is not there yet): --watch exits 1
        prefect("deployment", "run", "post-training/tiny-cpu", "--watch",
                "--param", f"overrides={json.dumps(overrides)}", "--param", f"store={json.dumps(str(store))}",
                "--param", 'run_id="deployed"', "--param", f"skip={json.dumps(list(OPTIONAL))}",
                timeout=480, expect=1)
        sft_manifest = store / "deployed" / "sft" / "checkpoint" / "iter_0000001" / "manifest.json"
        committed_at = json.loads(sft_manifest.read_text())["created_at"]

        # 2. fixed, then `prefect flow-run retry`: the worker runs it again and it continues at export
        shutil.copytree(tiny_kit.model_dir, origin)
        prefect("flow-run", "retry", "post-training-deployed")
        deadline = time.monotonic() + 300
        while True:
            (run,) = api("flow_runs/filter", {"flow_runs": {"name": {"any_": ["post-training-deployed"]}}})
            if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED"):
                break
            assert time.monotonic() < deadline, f"retry still {run['state_type']}:\n{read(tmp_path / 'worker.log')}"
            time.sleep(3)
        assert run["state_type"] == "COMPLETED", read(tmp_path / "worker.log")
        assert ArtifactStore(str(store)).committed("deployed", "export") == ["hf"]
        assert json.loads(sft_manifest.read_text())["created_at"] == committed_at  # sft was not run again
        states = {}
        for task_run in api("task_runs/filter", {"task_runs": {"name": {"any_": ["convert-deployed", "sft-deployed",
                                                                                 "export-deployed"]}}}):
            states.setdefault(task_run["name"], []).append(task_run["state_name"])
        assert sorted(states["sft-deployed"]) == ["Cached", "Completed"]
        assert sorted(states["convert-deployed"]) == ["Cached", "Completed"]
        assert sorted(states["export-deployed"]) == ["Completed", "Failed"]
    finally:
        for proc in (worker, server):
            if proc is not None:
                stop(proc)
        for log in logs.values():
            log.close()
