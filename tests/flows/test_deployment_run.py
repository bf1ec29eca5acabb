"""A real `prefect server` + `slime-local` process worker + `prefect deploy --all` +
`prefect deployment run 'post-training/tiny-cpu' --watch` of the tiny pipeline (slow: ~3-4 min here)."""

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

from slime.engines.process import find_free_port
from slime.storage import ArtifactStore, is_committed

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

        def prefect(*args, timeout=300):
            done = subprocess.run([PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            return done.stdout

        prefect("work-pool", "create", "slime-local", "--type", "process")
        assert "post-training/tiny-cpu" in prefect("deploy", "--all", "--no-prompt")
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "slime-local"], cwd=ROOT, env=env,
                                  stdout=logs["worker"], stderr=subprocess.STDOUT)
        overrides = ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]",
                     "--sft-num-epoch", "1"]
        store = tmp_path / "store"
        try:
            prefect("deployment", "run", "post-training/tiny-cpu", "--watch",
                    "--param", f"overrides={json.dumps(overrides)}", "--param", f"store={json.dumps(str(store))}",
                    "--param", 'run_id="deployed"', timeout=480)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nworker log:\n{(tmp_path / 'worker.log').read_text()[-4000:]}") from None
        layout = ArtifactStore(str(store))
        assert layout.committed("deployed", "export") == ["hf"]
        assert is_committed(str(store / "deployed" / "sft" / "checkpoint" / "iter_0000001"))
    finally:
        for proc in (worker, server):
            if proc is not None:
                stop(proc)
        for log in logs.values():
            log.close()
