"""The soak test: 500 RL iterations of the tiny CPU pipeline through the Prefect RL flow (Ray, the built-in
engine, Megatron on CPU), a checkpoint every 25 kept 2 deep, saved in the background (bench/soak.py; about
20 minutes on the 2-core machine). After warm-up nothing may grow but what a run must accumulate:

- RSS of the driver, every Ray actor of ours (and what it spawned for good), the engine and the reward
  grader: its trough (10% quantile of the samples: what the process keeps between calls) and its crest (90%
  quantile: its size inside a call) over iterations 450-500 each within 10% of the same over 50-100 (0-50 is
  warm-up: the first saves allocate the async saver's buffers, the engine its caches). A leak raises both. Not
  the median: a train rank swings by a third of its size in every call, so its median follows the share of
  samples that land inside calls, which grows when the calls do (longer responses later in the run);
- Prefect's cost per iteration (`prefect_s` of the metrics-table rows): median over 450-500 within 20% of
  the median over 10-60;
- the Prefect database and the run's store (RL checkpoints apart) grow linearly: their bytes per iteration
  between iterations 100, 200, ..., 500 each within 25% of the median of those four;
- the checkpoint directory never holds more than the kept checkpoints plus the one being written (+1%: the
  checkpoints' JSON files differ by a few bytes).

Each criterion is its own test over the one run (module fixture), so a failure shows every other figure.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak  # noqa: E402

ITERATIONS = 500
SAVE_INTERVAL, KEEP = 25, 2
RSS_TOLERANCE = 0.10
PREFECT_TOLERANCE = 0.20
GROWTH_TOLERANCE = 0.25
EXPECTED_ROLES = {"driver", "engine", "grader", "ray::TrainActor", "ray::RolloutManager"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    work = tmp_path_factory.mktemp("soak")
    result = soak.run_soak(ITERATIONS, work / "run", save_interval=SAVE_INTERVAL, keep=KEEP)
    (work / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    print(soak.table(result))  # shown with -s, and beside any failure
    return result


def test_every_iteration_ran_and_reported_its_prefect_cost(summary):
    assert summary["iterations_logged"] == ITERATIONS, f"metrics.jsonl holds {summary['iterations_logged']} records"
    assert summary["prefect_s"]["iterations"] == ITERATIONS, "the flow's rows lack prefect_s for some iterations"


def test_rss_of_driver_actors_and_engine_is_flat_after_warmup(summary):
    checked = {name: p for name, p in summary["rss"].items() if p["checked"]}
    missing = EXPECTED_ROLES - set(checked)
    assert not missing, f"processes not found under the flow (or not labelled): {missing}"
    early, late = summary["windows"]["rss"]["early"], summary["windows"]["rss"]["late"]
    problems = []
    for name, p in sorted(checked.items()):
        if not p["samples_early"]:
            continue  # started after the early window: nothing to compare with
        if not p["samples_late"]:
            problems.append(f"{name} ({p['early_mb']} MB over iterations {early}) was gone in {late}")
        else:
            for part in ("low", "high"):
                if abs(p[f"{part}_ratio"] - 1) > RSS_TOLERANCE:
                    problems.append(
                        f"{name}: RSS {'trough' if part == 'low' else 'crest'} {p[f'early_{part}_mb']} MB over iterations "
                        f"{early}, {p[f'late_{part}_mb']} MB over {late} (x{p[f'{part}_ratio']}, more than "
                        f"{RSS_TOLERANCE:.0%} apart; medians {p['early_mb']} -> {p['late_mb']} MB)")
    assert not problems, "\n".join(problems)


def test_prefect_cost_per_iteration_is_flat(summary):
    p, windows = summary["prefect_s"], summary["windows"]["prefect"]
    assert abs(p["ratio"] - 1) <= PREFECT_TOLERANCE, (
        f"prefect_s median {p['early_median']} s over iterations {windows['early']}, {p['late_median']} s over "
        f"{windows['late']}: x{p['ratio']}, more than {PREFECT_TOLERANCE:.0%} apart")


@pytest.mark.parametrize("column", ["prefect_db_bytes", "store_bytes"])
def test_prefect_database_and_store_grow_linearly(summary, column):
    marks = [s["iteration"] for s in summary["sizes"]]
    assert len(marks) == 5, f"sizes taken at iterations {marks}, not at 5 milestones"
    per_iteration = summary["growth_bytes_per_iteration"][column]
    mid = statistics.median(per_iteration)
    assert mid > 0, f"{column} did not grow: {[s[column] for s in summary['sizes']]}"
    off = [g for g in per_iteration if abs(g / mid - 1) > GROWTH_TOLERANCE]
    assert not off, (f"{column}: bytes per iteration between iterations {marks} are {per_iteration} (median "
                     f"{mid:.0f}); {off} are more than {GROWTH_TOLERANCE:.0%} off: not linear")


def test_checkpoint_disk_use_is_bounded_by_retention(summary):
    c = summary["checkpoints"]
    newest = [f"iter_{i:07d}" for i in (ITERATIONS - 1 - SAVE_INTERVAL, ITERATIONS - 1)]
    assert c["final"] == newest, f"committed checkpoints at the end: {c['final']}, not the newest {KEEP}: {newest}"
    assert c["peak_iter_dirs"] <= KEEP + 1, f"{c['peak_iter_dirs']} iter_* directories at once (keep {KEEP} + 1)"
    assert c["peak_bytes"] <= c["bound_bytes"], (
        f"checkpoint directory peaked at {c['peak_bytes']} bytes, over {KEEP} + 1 checkpoints of "
        f"{c['one_checkpoint_bytes']} bytes +1% ({c['bound_bytes']})")
    at = {s["iteration"]: s["checkpoint_bytes"] for s in summary["sizes"]}
    assert max(at.values()) <= c["bound_bytes"], f"checkpoint bytes at milestones {at} over {c['bound_bytes']}"
