"""Prefect's cost per RL iteration over a long run: `tasks/rl.py`'s `drive` with steps that do nothing.

The RL stage drives one long-lived loop through Prefect task runs per step (rollout, train, save, sync, eval),
updates a progress artifact and re-publishes the metrics table after every iteration. Whatever that costs
must stay flat from iteration 3 to iteration 3,000. Here a stand-in loop with RLLoop's interface (each step
returns at once; `log_step` appends the iteration's record to metrics.jsonl as the real loop does) is driven
for `--iterations` iterations inside one flow run, against a fresh local `prefect server start` (SQLite, its
own PREFECT_HOME; `--local-server PORT`), as deployments use, or else the API in PREFECT_API_URL, or else
Prefect's ephemeral API.

Printed: Prefect's seconds per iteration (`prefect_s`: the iteration's wall time minus the steps' own time,
what `drive` logs and tabulates) as the median of iterations 10-59 and of the last 50, and their ratio.

    python bench/orchestration.py --iterations 3000 --local-server 4391

Figures: docs/benchmarks.md, "Orchestration over long runs".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.settings import PREFECT_API_URL, temporary_settings

from slime.engines.process import ServerProcess
from slime.storage import ArtifactStore
from tasks._stage import Phases
from tasks.rl import drive


class IdleLoop:
    """What `drive` calls on an RLLoop, every step instant; a checkpoint every `save_interval` iterations and
    an eval every `eval_interval`, both as no-ops."""

    def __init__(self, root: str, run_id: str, iterations: int, save_interval: int, eval_interval: int) -> None:
        self.store = ArtifactStore(root)
        self.metrics_uri = self.store.uri(run_id, "rl", "metrics.jsonl")
        Path(self.metrics_uri).parent.mkdir(parents=True, exist_ok=True)
        self.start_rollout_id, self.num_rollout = 0, iterations
        self.save_interval, self.eval_interval = save_interval, eval_interval

    def eval_due(self, rollout_id: int, before_train: bool = False) -> bool:
        return not before_train and (rollout_id + 1) % self.eval_interval == 0

    def save_due(self, rollout_id: int) -> bool:
        return (rollout_id + 1) % self.save_interval == 0

    def rollout(self, rollout_id: int) -> dict[str, Any]:
        return {"uri": self.store.uri("bench", "rollout", f"{rollout_id:07d}")}

    def train(self, rollout_id: int, uri: str) -> dict[str, Any]:
        return {}

    def maybe_save(self, rollout_id: int) -> dict[str, Any]:
        return {"saved": True}

    def sync(self, rollout_id: int) -> dict[str, Any]:
        return {}

    def maybe_eval(self, rollout_id: int, before_train: bool = False) -> dict[str, Any]:
        return {}

    def log_step(self, rollout_id: int) -> dict[str, Any]:
        record = {"rollout_id": rollout_id, "weight_version": rollout_id + 1, "rl/reward_mean": 0.5,
                  "rl/grad_norm": 1.0, "rl/rollout_s": 0.0, "rl/train_s": 0.0, "rl/sync_s": 0.0}
        with open(self.metrics_uri, "a") as out:
            out.write(json.dumps(record) + "\n")
        return record


@flow(name="bench-orchestration")
def idle_rl(root: str, iterations: int, save_interval: int, eval_interval: int) -> list[dict[str, Any]]:
    loop = IdleLoop(root, "bench", iterations, save_interval, eval_interval)
    return drive(loop, "bench", Phases())


@contextlib.contextmanager
def local_server(port: int | None, home: str) -> Iterator[None]:
    """A `prefect server start` on 127.0.0.1:`port` with its own PREFECT_HOME under `home`, used as the API
    inside the block and stopped after it (its database size printed); nothing when `port` is None."""
    if port is None:
        yield
        return
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
    env = {**os.environ, "PREFECT_HOME": f"{home}/prefect-home", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    url = f"http://127.0.0.1:{port}"
    with ServerProcess([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                       log_path=f"{home}/server.log", env=env, name="prefect server") as server:
        server.wait_healthy(f"{url}/api/health", timeout_s=180, interval_s=1.0)
        with temporary_settings(updates={PREFECT_API_URL: f"{url}/api"}):
            yield
    db = Path(home, "prefect-home", "prefect.db")
    print(f"Prefect database after the run: {db.stat().st_size / 1e6:.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--save-interval", type=int, default=50)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--local-server", type=int, metavar="PORT", help="run against a fresh local Prefect "
                        "server on this port (else PREFECT_API_URL, else the ephemeral API)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="slime-bench-orchestration-") as root, \
            local_server(args.local_server, root):
        started = time.perf_counter()
        rows = idle_rl(root, args.iterations, args.save_interval, args.eval_interval)
        wall = time.perf_counter() - started
    costs = [row["prefect_s"] for row in rows]
    early = statistics.median(costs[10:60])
    late = statistics.median(costs[-50:])
    print(f"{args.iterations} iterations in {wall:.1f} s; Prefect per iteration: iterations 10-59 {early:.3f} s, "
          f"last 50 {late:.3f} s (ratio {late / early:.2f}); max {max(costs):.3f} s at iteration "
          f"{costs.index(max(costs))}")


if __name__ == "__main__":
    main()
