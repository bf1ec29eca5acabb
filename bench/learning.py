"""Does the embedded default learn? The whole pipeline once per seed, held-out accuracy stage over stage.

For each seed this runs `python -m flows.pipeline --config CONFIG` as a fresh run (its own run id under
`--store`, `--seed S --rollout-seed S`, so model training order, sampling and rollouts all change with the
seed; the tiny kit, and so the initial weights and the data, stay those of the recipe) and reads the
accuracy the evaluate stage measured for the untrained (converted), SFT and RL checkpoints, plus the time
of each stage. It prints one row per seed and the mean and spread (sample standard deviation, min..max)
of each, and writes them as JSON to `--out`.

    python bench/learning.py --seeds 1 2 3            # about 8-10 minutes per seed on 2 CPU cores

`--rl-variant NAME "FLAGS"` (repeatable) also runs, for each seed, the RL flow again from that seed's SFT
checkpoint with FLAGS on top (its own run id), and compares the variants' last in-run eval with the
pipeline's own RL run (same SFT start, same eval), e.g. the async modes:

    python bench/learning.py --seeds 1 2 3 --rl-variant fully-k1 "--async-mode fully --max-policy-version-lag 1 \
        --partial-rollout" --rl-variant fully-k2 "--async-mode fully --max-policy-version-lag 2 --partial-rollout"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("convert", "sft", "rejection_sampling", "rl", "evaluate", "export")


def run_pipeline(config: str, store: str, seed: int, extra: list[str],
                 stream_logs: bool = False) -> tuple[dict[str, Any], float]:
    """One pipeline run as a subprocess; its JSON result (stdout) and wall seconds. Its log (stderr, where
    Prefect and slime log) is kept and shown on failure, or with `stream_logs` passed through as it comes, so
    a run stopped from outside (a time limit) still shows how far it got."""
    cmd = [sys.executable, "-m", "flows.pipeline", "--config", config, "--store", store,
           "--run-id", f"learn-seed{seed}", "--seed", str(seed), "--rollout-seed", str(seed), "--json", *extra]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=None if stream_logs else subprocess.PIPE,
                          text=True, env=os.environ.copy())
    wall = time.monotonic() - start
    if done.returncode != 0:
        log = "(its log is above)" if stream_logs else done.stderr[-3000:]
        sys.exit(f"seed {seed}: pipeline exited {done.returncode}\n{done.stdout[-3000:]}\n{log}")
    text = done.stdout
    result, _ = json.JSONDecoder().raw_decode(text[text.index("\n{") + 1 if not text.startswith("{") else 0:])
    return result, wall


def run_rl_variant(config: str, store: str, seed: int, name: str, sft_checkpoint: str, flags: list[str],
                   extra: list[str]) -> float:
    """The RL flow from `sft_checkpoint` with `flags`; the last in-run eval's mean reward (its pass@1 with
    the config's greedy single-sample eval)."""
    run_id = f"learn-seed{seed}-{name}"
    cmd = [sys.executable, "-m", "flows.rl", "--config", config, "--store", store, "--run-id", run_id,
           "--model", sft_checkpoint, "--seed", str(seed), "--rollout-seed", str(seed), "--json", *extra, *flags]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        sys.exit(f"seed {seed} {name}: rl flow exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return last_eval(f"{store}/{run_id}/rl/metrics.jsonl")


def last_eval(metrics_uri: str, dataset: str = "arithmetic") -> float:
    from slime.rl.metrics import read_metrics

    records = read_metrics(metrics_uri)
    key = f"eval/{dataset}/mean_reward"
    return next(records[i][key] for i in sorted(records, reverse=True) if key in records[i])


def accuracy_by_stage(result: dict[str, Any], dataset: str, metric: str) -> dict[str, float]:
    """The evaluate stage's figure for the checkpoint each of convert, sft and rl produced."""
    produced_by = {result[s]["artifacts"]["checkpoint"]["uri"]: s for s in ("convert", "sft", "rl") if s in result}
    out = {}
    for evaluated in [*result["evaluate"].get("compared", []), result["evaluate"]]:
        metrics = evaluated["metrics"]
        out[produced_by[metrics["checkpoint"]]] = metrics["datasets"][dataset][metric]
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="deployments/tiny-cpu.yaml")
    parser.add_argument("--store", default="runs/learning", help="store root for the runs (one run id per seed)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--dataset", default="arithmetic", help="eval dataset name in the config")
    parser.add_argument("--metric", default="pass@1")
    parser.add_argument("--out", default=None, help="JSON file for the figures (default: STORE/learning.json)")
    parser.add_argument("--rl-variant", nargs=2, action="append", default=[], metavar=("NAME", "FLAGS"),
                        help="also RL from each seed's SFT checkpoint with FLAGS; compared on the in-run eval")
    parser.add_argument("--stream-logs", action="store_true",
                        help="pass each pipeline's log through as it runs (default: shown only if it fails)")
    args, extra = parser.parse_known_args()
    store = str(Path(args.store).absolute())

    rows = []
    for seed in args.seeds:
        result, wall = run_pipeline(args.config, store, seed, extra, args.stream_logs)
        acc = accuracy_by_stage(result, args.dataset, args.metric)
        seconds = {s: round(sum(result[s].get("seconds", {}).values()), 1) for s in STAGES if s in result}
        rows.append({"seed": seed, "accuracy": acc, "stage_seconds": seconds, "wall_s": round(wall, 1)})
        print(f"seed {seed}: {args.metric} untrained {acc['convert']:.3f}  sft {acc['sft']:.3f}  rl {acc['rl']:.3f}"
              f"  (pipeline {wall:.0f} s: " + ", ".join(f"{s} {v}" for s, v in seconds.items()) + ")", flush=True)
        if args.rl_variant:
            variants = {"pipeline-rl": last_eval(f"{store}/learn-seed{seed}/rl/metrics.jsonl", args.dataset)}
            sft = result["sft"]["artifacts"]["checkpoint"]["uri"]
            for name, flags in args.rl_variant:
                variants[name] = run_rl_variant(args.config, store, seed, name, sft, flags.split(), extra)
            rows[-1]["rl_in_run_eval"] = variants
            print(f"seed {seed}: in-run eval after RL " + "  ".join(f"{n} {v:.3f}" for n, v in variants.items()),
                  flush=True)

    summary = {stage: spread([r["accuracy"][stage] for r in rows]) for stage in ("convert", "sft", "rl")}
    summary["rl_minus_sft"] = spread([r["accuracy"]["rl"] - r["accuracy"]["sft"] for r in rows])
    summary["wall_s"] = spread([r["wall_s"] for r in rows])
    for name in ["pipeline-rl", *(n for n, _ in args.rl_variant)] if args.rl_variant else []:
        summary[f"rl_eval:{name}"] = spread([r["rl_in_run_eval"][name] for r in rows])
    print(f"\n{args.metric} on '{args.dataset}' over seeds {args.seeds}:")
    for key, s in summary.items():
        print(f"  {key:<13} mean {s['mean']:.3f}  stdev {s['stdev']:.3f}  range {s['min']:.3f}..{s['max']:.3f}")
    out = Path(args.out or Path(args.store) / "learning.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.config, "extra": extra, "runs": rows, "summary": summary}, indent=1))
    print(f"figures: {out}")


if __name__ == "__main__":
    main()
