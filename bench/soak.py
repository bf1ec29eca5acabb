"""Soak: the tiny CPU pipeline's RL through the Prefect RL flow for 500 iterations, checkpoints with retention.

What a long run must keep flat, measured on the real stack (`python -m flows.rl` on deployments/tiny-cpu.yaml:
Prefect's ephemeral API on SQLite, Ray, the built-in CPU engine behind sglang-router, Megatron training on CPU)
in a fresh store and PREFECT_HOME under one directory, from `slime convert` plus one epoch of `slime sft`
(`--sft-epochs`; from the untrained model every reward, so every gradient, is 0 and the weights never move):

- RSS of every process under the flow process, labelled by role from its command line (the driver; the Ray
  actors `ray::TrainActor`, `ray::RolloutManager`; the engine; the reward grader; raylet, gcs_server, Ray's
  agents, the Prefect API server, the router reported beside them), sampled every `--interval` s and mapped
  to the iteration in progress through metrics.jsonl's per-record `time` (written as an iteration ends).
  Median, 10% quantile (the trough between calls: what a process keeps) and 90% quantile (the crest inside
  calls) per role (its processes summed at each sample) and per process over the early window (iterations
  N/10 to N/5: 50-100 of 500; iterations before N/10 are warm-up) and the late window (the last N/10);
- Prefect's cost per iteration (`prefect_s` of the flow result's rows: the metrics-table rows of tasks/rl.py's
  `drive`, the iteration's wall time minus the loop's own steps), medians of iterations N/50 to N/50 + N/10
  (10-60) and of the last N/10;
- the bytes of the Prefect database (pages in use, read through SQLite, WAL included; the files too), of the
  run's store without the RL checkpoints, and of the RL checkpoint directory, when metrics.jsonl reaches each
  of N/5, 2N/5, ... N iterations; the checkpoint directory also at every sample (its peak, against retention).

Checkpoints every `--save-interval` (25) with `--keep-checkpoints` (2) and `--async-save`; evals off but one
at the last iteration on 8 prompts (slime's rule evaluates the last iteration whenever an interval is set).
Ray's temp dir is the private one RayCluster.connect makes; every server binds 127.0.0.1. Only the processes
this script started are stopped, by PID, and only if the flow did not stop them itself.

    .venv/bin/python bench/soak.py --iterations 500 --out soak.json   # ~15-20 min on the 2-core CPU machine

The raw samples stay in `--workdir` (samples.json) with the flow's log, when one is given.

Figures: docs/benchmarks.md, "Soak: 500 RL iterations on the CPU kit". tests/flows/test_soak.py (slow)
asserts the criteria on a 500-iteration run.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deployments" / "tiny-cpu.yaml"
KIT_EVAL = ROOT / "runs" / "tiny-kit" / "data" / "eval.jsonl"  # the kit tiny-cpu.yaml names (built if missing)
RUN_ID = "soak"
MB = 1e6
# Ray's own processes that are titled like actors: its agents, and pooled workers without an actor yet
RAY_OWN = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


# --------------------------------------------------------------------------- windows of a run of N iterations

def rss_windows(n: int) -> dict[str, tuple[int, int]]:
    """Iterations [start, end) of warm-up, the early and the late RSS window (500: 0-50, 50-100, 450-500)."""
    return {"warmup": (0, n // 10), "early": (n // 10, n // 5), "late": (n - n // 10, n)}


def prefect_windows(n: int) -> dict[str, tuple[int, int]]:
    """Iterations [start, end) whose `prefect_s` medians are compared (500: 10-60 and 450-500)."""
    return {"early": (n // 50, n // 50 + n // 10), "late": (n - n // 10, n)}


def milestones(n: int) -> list[int]:
    """Completed iterations at which the database, store and checkpoint sizes are taken (500: 100, ..., 500)."""
    return [n * k // 5 for k in range(1, 6)]


# --------------------------------------------------------------------------- processes

def role(proc: psutil.Process, cmdline: list[str], root_pid: int, roles: dict[int, str]) -> str:
    """What a process under the flow is, from its command line (Ray titles actors `ray::Class.method`); a
    child of a labelled process that is not one of the servers below is named `<parent>/<what>`."""
    if proc.pid == root_pid:
        return "driver"
    line = " ".join(cmdline)
    parent = roles.get(proc.ppid(), "?")
    if match := re.match(r"ray::(\w+)", line):
        name = f"ray::{match.group(1)}"
        # a fork keeps its parent's title: megatron's save writers (forks of the rank, and their forks)
        return f"{name}/fork" if parent == name or parent.startswith(f"{name}/") else name
    executable = Path(cmdline[0]).name
    if executable in ("raylet", "gcs_server"):
        return executable
    for needle, name in (("slime.engines.builtin", "engine"), ("grading_process", "grader"),
                         ("prefect.server", "prefect-server"), ("multiprocessing.spawn", f"{parent}/spawn"),
                         ("multiprocessing.resource_tracker", f"{parent}/resource_tracker")):
        if needle in line:
            return name
    if line.startswith("sglang::router") or "sglang_router" in line:
        return "router"
    script = next((Path(a).name for a in cmdline[1:] if a.endswith(".py")), None)
    if script and "/ray/" in line:
        return f"ray:{script}"  # Ray's daemons (monitor.py, log_monitor.py, dashboard.py, default_worker.py)
    return f"{parent}/{script or executable}"


def tree_rss(root: psutil.Process, roles: dict[int, str], seen: dict[int, float]) -> dict[int, int]:
    """RSS (bytes) of `root` and every descendant now. Labels each PID in `roles` (again every time: a Ray
    worker starts as default_worker.py, is titled `ray::IDLE`, then takes its actor's name) and its start
    time in `seen`."""
    rss: dict[int, int] = {}
    try:
        procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    except psutil.Error:
        return rss

    def label(proc: psutil.Process) -> None:
        if proc.ppid() in procs and proc.ppid() not in rss:
            with contextlib.suppress(psutil.Error):
                label(procs[proc.ppid()])  # the parent first: a fork is named after it
        cmdline = proc.cmdline()
        if not cmdline or proc.status() == psutil.STATUS_ZOMBIE:
            return  # exiting or exited (no command line, no memory), not yet reaped
        roles[proc.pid] = role(proc, cmdline, root.pid, roles)
        seen.setdefault(proc.pid, proc.create_time())
        rss[proc.pid] = proc.memory_info().rss

    for proc in procs.values():
        if proc.pid not in rss:
            with contextlib.suppress(psutil.Error):
                label(proc)
    return rss


# --------------------------------------------------------------------------- sizes

def tree_bytes(path: Path, skip: Path | None = None) -> int:
    """Bytes of the files under `path` (not following links), leaving out `skip`; files vanishing are skipped."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        if skip is not None:
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def db_bytes(db: Path) -> dict[str, int]:
    """The Prefect database: bytes of its pages in use as SQLite sees them (the WAL's committed frames
    included, free pages not) and of its files. The files alone jump by the WAL's size as it is checkpointed."""
    files = sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())
    used = 0
    with contextlib.suppress(sqlite3.Error), contextlib.closing(
            sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        pages, free, size = (conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count",
                                                                                   "page_size"))
        used = (pages - free) * size
    return {"used": used, "files": files}


def committed_checkpoints(save: Path) -> list[str]:
    return sorted(p.parent.name for p in save.glob("iter_*/manifest.json"))


# --------------------------------------------------------------------------- sampling

class Sampler(threading.Thread):
    """Every `interval` s: RSS of the flow's process tree and the checkpoint directory's bytes; when
    metrics.jsonl passes a milestone, the sizes of the database, the store and the checkpoints."""

    def __init__(self, pid: int, paths: dict[str, Path], marks: list[int], interval: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.root, self.paths, self.marks, self.interval = psutil.Process(pid), paths, list(marks), interval
        self.roles: dict[int, str] = {}
        self.rss: list[tuple[float, dict[int, int]]] = []
        self.checkpoint: list[tuple[float, int, int]] = []  # (time, bytes, iter_* directories)
        self.sizes: list[dict[str, Any]] = []
        self.load: list[float] = []  # the machine's 1-minute load average (it is shared)
        self.seen: dict[int, float] = {}  # PID -> start time of every process seen: what to stop if the flow does not
        self.done = threading.Event()
        self._offset, self._completed = 0, 0

    def completed(self) -> int:
        """Iterations in metrics.jsonl so far (read on from where the last call stopped)."""
        with contextlib.suppress(FileNotFoundError), open(self.paths["metrics"], "rb") as log:
            log.seek(self._offset)
            data = log.read()
            whole = data[:data.rfind(b"\n") + 1]
            self._offset += len(whole)
            self._completed += whole.count(b"\n")
        return self._completed

    def run(self) -> None:
        while not self.done.is_set():
            now = time.time()
            rss = tree_rss(self.root, self.roles, self.seen)
            self.load.append(os.getloadavg()[0])
            if rss:
                self.rss.append((now, rss))
            save = self.paths["checkpoint"]
            self.checkpoint.append((now, tree_bytes(save), len(list(save.glob("iter_*")))))
            completed = self.completed()
            if self.marks and completed >= self.marks[0]:
                while self.marks and completed >= self.marks[0]:
                    self.marks.pop(0)
                self.sizes.append(self.measure(completed))
            self.done.wait(self.interval)

    def measure(self, completed: int) -> dict[str, Any]:
        db = db_bytes(self.paths["db"])
        run, save = self.paths["run"], self.paths["checkpoint"]
        return {"iteration": completed, "prefect_db_bytes": db["used"], "prefect_db_file_bytes": db["files"],
                "store_bytes": tree_bytes(run, skip=save), "checkpoint_bytes": tree_bytes(save),
                "checkpoints_committed": committed_checkpoints(save)}


# --------------------------------------------------------------------------- the run

def run_soak(iterations: int = 500, workdir: str | Path | None = None, save_interval: int = 25, keep: int = 2,
             interval: float = 2.0, sft_epochs: int = 1, async_save: bool = True,
             timeout_s: float | None = None) -> dict[str, Any]:
    """Convert and SFT (`slime convert`, `slime sft`), then the RL flow for `iterations` (it starts from the
    run's newest SFT checkpoint) under the sampler; the summary (see `summarize`)."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="slime-soak-"))
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        store, home = work / "store", work / "prefect-home"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # no outer API or home
        env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
        base = ["--config", str(CONFIG), "--store", str(store), "--run-id", RUN_ID]
        # the start: the kit's model converted, then `sft_epochs` of SFT (from the untrained model every reward
        # is 0, so every gradient is: the weights would never change; one epoch gives some right answers)
        stages = [["convert"]]
        if sft_epochs:
            stages.append(["sft", "--load", str(store / RUN_ID / "convert" / "checkpoint"),
                           "--sft-num-epoch", str(sft_epochs)])
        for stage, *extra in stages:
            with open(work / f"{stage}.log", "wb") as log:
                subprocess.run([sys.executable, "-m", "slime", stage, *base, *extra], env=env, cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT, check=True, timeout=1800)
        command = [sys.executable, "-m", "flows.rl", *base, "--num-rollout", str(iterations),
                   "--save-interval", str(save_interval), "--keep-checkpoints", str(keep),
                   *(["--async-save"] if async_save else []), "--eval-interval", str(iterations + 1),
                   "--skip-eval-before-train", "--eval-prompt-data", "arithmetic", f"{KIT_EVAL}@[0:8]"]
        run = store / RUN_ID
        paths = {"run": run, "metrics": run / "rl" / "metrics.jsonl", "checkpoint": run / "rl" / "checkpoint",
                 "db": home / "prefect.db"}
        timeout_s = timeout_s or 900 + 8 * iterations
        load = os.getloadavg()
        started = time.time()
        with open(work / "flow.out", "wb") as out, open(work / "flow.log", "wb") as err:
            flow = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=err)
        sampler = Sampler(flow.pid, paths, milestones(iterations), interval)
        sampler.start()
        try:
            returncode = flow.wait(timeout=timeout_s)
        finally:
            sampler.done.set()
            sampler.join()
            stop(flow, sampler.seen)
        wall = time.time() - started
        (work / "samples.json").write_text(json.dumps({  # the raw samples, to look again at a run
            "roles": sampler.roles, "rss": sampler.rss, "checkpoint": sampler.checkpoint, "sizes": sampler.sizes}))
        log_tail = (work / "flow.log").read_text(errors="replace")[-4000:]
        if returncode != 0:
            raise RuntimeError(f"the RL flow exited {returncode}; its log ends:\n{log_tail}")
        result = flow_result((work / "flow.out").read_text())
        records = [json.loads(line) for line in paths["metrics"].read_text().splitlines()]
        summary = summarize(iterations, sampler, records, result["rows"], keep)
        summary.update({"command": " ".join(["python", *command[1:]]), "wall_s": round(wall, 1),
                        "machine": {"cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in load],
                                    "load_avg_1min_median": round(median(sampler.load) or 0, 2),
                                    "load_avg_1min_max": round(max(sampler.load, default=0), 2)},
                        "save_interval": save_interval, "keep_checkpoints": keep, "sample_interval_s": interval,
                        "sft_epochs": sft_epochs, "async_save": async_save})
        return summary


def flow_result(stdout: str) -> dict[str, Any]:
    """The flow's JSON result in its stdout (printed by flows/_cli.py, the UI hint after it)."""
    start = 0 if stdout.startswith("{") else stdout.index("\n{") + 1
    return json.JSONDecoder().raw_decode(stdout[start:])[0]


def stop(flow: subprocess.Popen, seen: dict[int, float]) -> None:
    """The flow (SIGTERM: it stops its Ray cluster, engines and API server), then, by PID (and start time: not
    a reused PID), whatever it left of the processes the sampler saw under it."""
    if flow.poll() is None:
        flow.terminate()
        try:
            flow.wait(timeout=120)
        except subprocess.TimeoutExpired:
            flow.kill()
            flow.wait()
    time.sleep(2)
    for pid, created in seen.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()


# --------------------------------------------------------------------------- summary

def quantile(values: list[float], q: float) -> float | None:
    """The `q` quantile of `values` (None when empty). A process that allocates per call swings between a
    trough (what it keeps between calls) and a peak (inside a call); the 10% and 90% quantiles follow those two,
    where the median follows the share of samples that fell inside calls, which changes with the calls' length."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def ratio(late: float | None, early: float | None) -> float | None:
    return round(late / early, 4) if late is not None and early else None


def summarize(n: int, sampler: Sampler, records: list[dict[str, Any]], rows: list[dict[str, Any]],
              keep: int) -> dict[str, Any]:
    """RSS per role and per process in the two windows, prefect_s medians, sizes at milestones and their growth per
    iteration between milestones, the checkpoint directory's peak."""
    ends = sorted(r["time"] for r in records)  # iteration i ended at ends[i]
    windows = rss_windows(n)

    def window_of(t: float) -> str | None:
        current = bisect.bisect_right(ends, t)  # the iteration in progress at t
        return next((name for name, (a, b) in windows.items() if a <= current < b), None)

    def stats(series: list[tuple[float, int]]) -> dict[str, Any]:
        split: dict[str, list[int]] = {name: [] for name in windows}
        for t, value in series:
            if name := window_of(t):
                split[name].append(value)
        early, late = median(split["early"]), median(split["late"])
        lows = [quantile(split[w], 0.1) for w in ("early", "late")]
        highs = [quantile(split[w], 0.9) for w in ("early", "late")]
        return {"samples": len(series), "samples_early": len(split["early"]), "samples_late": len(split["late"]),
                "warmup_mb": mb(median(split["warmup"])), "early_mb": mb(early), "late_mb": mb(late),
                "peak_mb": mb(max(v for _, v in series)), "ratio": ratio(late, early),
                "early_low_mb": mb(lows[0]), "late_low_mb": mb(lows[1]), "low_ratio": ratio(lows[1], lows[0]),
                "early_high_mb": mb(highs[0]), "late_high_mb": mb(highs[1]), "high_ratio": ratio(highs[1], highs[0])}

    # per role, the RSS of its processes summed at each sample: a pool (the graders) may replace a child
    by_pid: dict[int, list[tuple[float, int]]] = {}
    by_role: dict[str, list[tuple[float, int]]] = {}
    for t, rss in sampler.rss:
        totals: dict[str, int] = {}
        for pid, value in rss.items():
            by_pid.setdefault(pid, []).append((t, value))
            totals[sampler.roles[pid]] = totals.get(sampler.roles[pid], 0) + value
        for name, value in totals.items():
            by_role.setdefault(name, []).append((t, value))
    pids = {name: sorted(pid for pid in by_pid if sampler.roles[pid] == name) for name in by_role}
    roles = {name: {"checked": checked(name), "pids": pids[name], **stats(series)}
             for name, series in sorted(by_role.items())}
    processes = {str(pid): {"role": sampler.roles[pid], **stats(series)} for pid, series in sorted(by_pid.items())}
    prefect = {int(r["iteration"]): r["prefect_s"] for r in rows if r.get("prefect_s") is not None}
    pw = prefect_windows(n)
    medians = {name: median([s for i, s in prefect.items() if a <= i < b]) for name, (a, b) in pw.items()}
    wall = {i: ends[i] - ends[i - 1] for i in range(1, len(ends))}
    sizes = sampler.sizes
    growth = {}
    for column in ("prefect_db_bytes", "prefect_db_file_bytes", "store_bytes"):
        growth[column] = [round((b[column] - a[column]) / (b["iteration"] - a["iteration"]))
                          for a, b in zip(sizes, sizes[1:], strict=False)]  # bytes per iteration
    peak = max(sampler.checkpoint, key=lambda s: s[1], default=(0, 0, 0))
    final = committed_checkpoints(sampler.paths["checkpoint"])
    one = max((tree_bytes(sampler.paths["checkpoint"] / name) for name in final), default=0)
    return {
        "iterations": n, "iterations_logged": len(records),
        "windows": {"rss": windows, "prefect": pw},
        "rss": roles, "rss_per_process": processes,
        "prefect_s": {"early_median": medians["early"], "late_median": medians["late"],
                      "ratio": ratio(medians["late"], medians["early"]), "max": max(prefect.values(), default=None),
                      "over_1s": sum(s > 1.0 for s in prefect.values()), "iterations": len(prefect)},
        "iteration_s": {name: median([w for i, w in wall.items() if a <= i < b]) for name, (a, b) in pw.items()},
        "sizes": sizes, "growth_bytes_per_iteration": growth,
        "checkpoints": {"keep": keep, "final": final, "one_checkpoint_bytes": one, "peak_bytes": peak[1],
                        "peak_iter_dirs": max((s[2] for s in sampler.checkpoint), default=0),
                        # keep committed + the one being written; +1%: their JSON files differ by a few bytes
                        "bound_bytes": round((keep + 1) * one * 1.01)},
    }


def checked(label: str) -> bool:
    """Whether a process's RSS is under the flatness criterion: the driver, the engine and the reward grader,
    every Ray actor of ours and the processes it spawned for good (async saves' result queue); not Ray's
    own daemons and agents, raylet, gcs_server, the router, the Prefect API server."""
    head, _, tail = label.partition("/")
    if label in ("driver", "engine", "grader"):
        return True
    return head.startswith("ray::") and head not in RAY_OWN and tail in ("", "spawn")


def mb(value: float | None) -> float | None:
    return round(value / MB, 1) if value is not None else None


def table(summary: dict[str, Any]) -> str:
    """The figures as plain text."""
    w = summary["windows"]
    lines = [f"RSS MB, median (trough x, crest x: late/early of the 10% and 90% quantiles): warm-up {w['rss']['warmup']}, early {w['rss']['early']}, late {w['rss']['late']} "
             "(iterations [start, end)); a role's processes summed",
             f"  {'role':<34} {'checked':>7} {'warm-up':>8} {'early':>8} {'late':>8} {'late/early':>10} {'peak':>8} "
             f"{'trough x':>8} {'crest x':>8}"]
    for name, p in sorted(summary["rss"].items(), key=lambda kv: (not kv[1]["checked"], kv[0])):
        if p["early_mb"] is None and p["late_mb"] is None:
            continue  # transient (save writers, Ray's worker start-up)
        label = name if len(p["pids"]) == 1 else f"{name} ({len(p['pids'])} processes)"
        lines.append(f"  {label:<34} {'yes' if p['checked'] else '':>7} {p['warmup_mb'] or '':>8} "
                     f"{p['early_mb'] or '':>8} {p['late_mb'] or '':>8} {p['ratio'] or '':>10} {p['peak_mb']:>8} "
                     f"{p['low_ratio'] or '':>8} {p['high_ratio'] or '':>8}")
    ps = summary["prefect_s"]
    lines.append(f"prefect_s median: iterations {w['prefect']['early']} {ps['early_median']}, {w['prefect']['late']} "
                 f"{ps['late_median']} (late/early {ps['ratio']}; max {ps['max']}, {ps['over_1s']} over 1 s); "
                 f"iteration wall s median {summary['iteration_s']}")
    lines.append(f"  {'iteration':>9} {'Prefect DB MB':>13} {'DB files MB':>11} {'store MB':>9} {'checkpoints MB':>14}")
    for s in summary["sizes"]:
        lines.append(f"  {s['iteration']:>9} {s['prefect_db_bytes'] / MB:>13.1f} {s['prefect_db_file_bytes'] / MB:>11.1f} "
                     f"{s['store_bytes'] / MB:>9.1f} {s['checkpoint_bytes'] / MB:>14.1f}")
    g = summary["growth_bytes_per_iteration"]
    lines.append(f"growth per iteration between milestones, KB: DB {[round(x / 1e3, 1) for x in g['prefect_db_bytes']]}, "
                 f"store {[round(x / 1e3, 1) for x in g['store_bytes']]}")
    c = summary["checkpoints"]
    lines.append(f"checkpoints: peak {c['peak_bytes'] / MB:.1f} MB ({c['peak_iter_dirs']} iter_* dirs), bound "
                 f"{c['bound_bytes'] / MB:.1f} MB (keep {c['keep']} + 1 x {c['one_checkpoint_bytes'] / MB:.1f} MB, +1%), "
                 f"final {c['final']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--save-interval", type=int, default=25)
    parser.add_argument("--keep-checkpoints", type=int, default=2)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--sft-epochs", type=int, default=1, help="SFT epochs before RL (0: RL from the converted "
                        "untrained model, whose rewards and gradients are all 0)")
    parser.add_argument("--no-async-save", action="store_true", help="checkpoints written in the step (to compare)")
    parser.add_argument("--workdir", help="keep the store, PREFECT_HOME and logs here (default: a temporary "
                        "directory, removed after)")
    parser.add_argument("--out", help="write the JSON summary here")
    args = parser.parse_args()
    summary = run_soak(args.iterations, args.workdir, args.save_interval, args.keep_checkpoints, args.interval,
                       args.sft_epochs, not args.no_async_save)
    text = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    print(table(summary))


if __name__ == "__main__":
    main()
