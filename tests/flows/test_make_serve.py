"""`make serve` as README.md says to use it (slow: 2 min 43 s on the idle 2-core machine): the target itself on a fresh PREFECT_HOME and a
free port, `prefect deployment run 'post-training/tiny-cpu' --watch` from another process (the tiny pipeline,
shrunk, into a temporary store), then one SIGINT to make's process group, as one Ctrl-C in its terminal.
The server's scheduler is off (nothing else runs on the worker); the deployment run does not need it.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from prefect_server import PREFECT, ROOT, tail

from slime.net import find_free_port
from slime.storage import ArtifactStore

START_TIMEOUT_S = 400  # server healthy (~50 s loaded), pools, six deployments, worker started
RUN_TIMEOUT_S = 900  # the shrunk pipeline through the worker: 133 s idle, a few minutes under load


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(log: Path, pattern: str, make: subprocess.Popen, timeout_s: float) -> re.Match:
    """The first match of `pattern` in make's output, waiting while make runs."""
    deadline = time.monotonic() + timeout_s
    while not (match := re.search(pattern, log.read_text(errors="replace"))):
        assert make.poll() is None, f"make serve exited {make.returncode}:\n{tail(log)}"
        assert time.monotonic() < deadline, f"no {pattern!r} after {timeout_s} s:\n{tail(log)}"
        time.sleep(1)
    return match


@pytest.mark.slow
def test_make_serve_runs_the_tiny_deployment_and_stops_on_one_sigint(tiny_kit, tmp_path):
    port, home, log = find_free_port(), tmp_path / "prefect-home", tmp_path / "make-serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # the session harness's are not ours
    # no runs from schedules: evaluate-newest's cron (:00, :30) would evaluate ./runs/tiny-cpu, building
    # runs/tiny-kit when missing, under this test's worker
    env["PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED"] = "false"
    pids: list[int] = []
    with open(log, "w") as out:
        # its own session: its process group gets the SIGINT a terminal's Ctrl-C would give make's job
        make = subprocess.Popen(["make", "serve", f"PORT={port}", f"PREFECT_HOME={home}"], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        server = int(wait_for(log, r"prefect server \(pid (\d+)\) starting", make, START_TIMEOUT_S)[1])
        pids.append(server)
        worker = int(wait_for(log, r"worker \(pid (\d+)\) serving work pool slime-local", make, START_TIMEOUT_S)[1])
        pids.append(worker)
        wait_for(log, r"Worker '.*' started!", make, START_TIMEOUT_S)
        printed = log.read_text()
        for deployment in ("post-training/tiny-cpu", "export/export", "post-training/qwen2.5-0.5b-gpu",
                           "evaluate/evaluate-newest", "post-training/multinode-gpu", "export/export-cpu"):
            assert f"Deployment '{deployment}' successfully created" in printed, deployment
        for pool in ("slime-local", "slime-gpu", "slime-cpu"):
            assert f"work pool {pool}: created (process)" in printed
        assert "needs its own worker on the Ray head node" in printed and f"Prefect UI: http://127.0.0.1:{port}" in printed
        assert (home / "prefect-server.log").is_file() and (home / "prefect.db").is_file()  # PREFECT_HOME=... took

        store = tmp_path / "store"
        overrides = ["--kit-dir", str(tiny_kit.root), "--kit-recipe", str(ROOT / "tests" / "tiny_kit_recipe.yaml"),
                     "--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]",
                     "--sft-num-epoch", "1", "--prompt-data", str(tiny_kit.train),
                     "--rs-prompt-data", f"{tiny_kit.train}@[0:4]", "--num-rollout", "2", "--rollout-batch-size", "2",
                     "--global-batch-size", "8", "--micro-batch-size", "4",
                     "--eval-prompt-data", "arithmetic", f"{tiny_kit.eval}@[0:4]"]
        started = time.monotonic()
        run = subprocess.run([PREFECT, "deployment", "run", "post-training/tiny-cpu", "--watch",
                              "--param", f"overrides={json.dumps(overrides)}",
                              "--param", f"store={json.dumps(str(store))}", "--param", 'run_id="served"'],
                             cwd=ROOT, env={**env, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"},
                             capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\nmake serve:\n{tail(log)}"
        print(f"deployment run: {time.monotonic() - started:.0f} s")
        assert "Completed" in run.stdout
        artifacts = ArtifactStore(str(store))
        assert artifacts.committed("served", "export") == ["hf"]
        assert artifacts.committed("served", "evaluate")
        assert sorted((store / "served" / "rl" / "checkpoint").glob("iter_*/manifest.json"))

        signalled = time.monotonic()
        os.killpg(make.pid, signal.SIGINT)  # one Ctrl-C
        make.wait(timeout=30)
        stopped_in = time.monotonic() - signalled
    finally:
        if make.poll() is None:  # only what this test started: make's group, the server's and the worker's
            for pgid in (make.pid, *pids):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
            make.wait()
    print(f"stopped {stopped_in:.1f} s after one SIGINT")
    printed = log.read_text()
    assert f"worker (pid {worker}) stopped" in printed and f"prefect server (pid {server}) stopped" in printed
    assert "SIGKILL" not in printed  # both stopped by their first signal, not after the timeout
    assert not group_alive(server) and not group_alive(worker) and not group_alive(make.pid)
