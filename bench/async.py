"""Samples trained per second in sync, one-step-off and fully async mode, side by side in one run.

    python bench/async.py --model tiny --prompts 4 --samples 4 --max-new-tokens 48            # CPU
    python bench/async.py --model 0.5b --prompts 32 --samples 8 --max-new-tokens 1024     # two GPUs
    python bench/async.py --model 0.5b --prompts 32 --samples 8 --max-new-tokens 1024 --share-gpu   # one GPU

Each mode runs `slime.rl.RLLoop` (Ray, one train rank, one built-in engine behind the real sglang-router,
no Prefect) for `--warmup` + `--iterations` GRPO steps on the same model, prompts and seed, with a sync
every step; the configuration is rollout-bound (long responses, a small model to train). The engine and
the trainer are separate Ray actors: on GPUs one each (async modes cannot release the engine's memory while
training), or with `--share-gpu` both on one GPU, each resident with its fraction of it (`cluster.share_gpu`,
`--train-gpu-fraction`/`--rollout-gpu-fraction`, 0.5 each by default); every mode then runs on that same
placement (weights synced by tensor), so the comparison is like for like. On the CPU they share the
cores. Throughput is the samples of the measured steps over their wall time (from the first
measured step's start to the last one's metrics line). Also reported per mode: median trainer idle (waiting
for a batch), median engine idle (fully async: nothing in flight), the largest staleness trained on and
the mean reward of the measured steps (learning is the same when these agree), and medians of where a step's
time goes (generation, training, log-probs, weight sync, pause, the step's wall time and what the loop spends
beyond those: `other_s`); from the sync row, the ceiling any overlap
can reach (generate + train + weight sync over the longer of generating and the other two). Prints a line per step
and a JSON line per mode as each ends (`--modes off,fully` runs a subset), then a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rl_step import workspace

from slime.config import Config
from slime.rl import RLLoop

MODES = ("off", "one_step_off", "fully")
# the measured parts of a step (the rest is "other_s"): waiting for the batch, training, pause, weight sync
STEP_PARTS = ("perf/rollout_wait_s", "rl/train_s", "perf/pause_generation_s", "rl/sync_s")


def build_config(args: argparse.Namespace, mode: str, model_dir: str, prompts: str, store: str,
                 cuda: bool) -> Config:
    n = args.prompts * args.samples
    cluster: dict[str, Any] = {"colocate": False, "offload_rollout": False, "offload_train": False}
    if cuda:
        cluster.update(actor_num_gpus_per_node=1, rollout_num_gpus=1)
    if args.share_gpu:  # the same one-GPU placement in every mode
        cluster.update(share_gpu=True, train_gpu_fraction=args.train_gpu_fraction,
                       rollout_gpu_fraction=args.rollout_gpu_fraction)
    return Config.model_validate({
        "run": {"store": store, "run_id": f"async-{mode}", "seed": 1},
        "cluster": cluster,
        "checkpoint": {"hf_checkpoint": model_dir},
        "data": {"prompt_data": prompts, "apply_chat_template": True},
        "rollout": {"rollout_batch_size": args.prompts, "n_samples_per_prompt": args.samples,
                    "num_rollout": args.warmup + args.iterations, "rollout_max_response_len": args.max_new_tokens,
                    "rollout_temperature": 1.0, "partial_rollout": mode == "fully"},
        "reward": {"rm_type": "math_verify"},
        "algorithm": {"advantage_estimator": "grpo"},
        "sync": {"async_mode": mode, "max_policy_version_lag": args.max_lag if mode == "fully" else None},
        "train": {"global_batch_size": n, "micro_batch_size": args.micro_batch_size, "lr": 1e-6},
        "megatron": {"bf16": cuda},
    })


def run_mode(args: argparse.Namespace, mode: str, model_dir: str, prompts: str, scratch: Path,
             cuda: bool) -> dict[str, Any]:
    """One mode's run; its throughput and idle figures over the measured steps."""
    config = build_config(args, mode, model_dir, prompts, str(scratch / "store"), cuda)
    loop = RLLoop(config, num_gpus=(1 if args.share_gpu else 2) if cuda else 0)
    records: list[dict[str, Any]] = []
    try:
        loop.setup()
        setup_end = time.monotonic()
        start = None
        for rollout_id in range(loop.num_rollout):
            step_start = time.monotonic()
            if rollout_id == args.warmup:
                start = step_start
            rollout = loop.rollout(rollout_id)
            loop.train(rollout_id, rollout["uri"])
            loop.sync(rollout_id)
            record = loop.log_step(rollout_id)
            # one line a step as it ends, so a run stopped by a time limit still shows how far it got
            print(f"[{mode}] step {rollout_id + 1}/{loop.num_rollout} done at {time.monotonic() - setup_end:.1f} s "
                  f"after setup", flush=True)
            if rollout_id >= args.warmup:
                records.append({**record, "bench/step_s": time.monotonic() - step_start})
        wall = time.monotonic() - start
    finally:
        loop.close()
    samples = len(records) * args.prompts * args.samples

    def median_of(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    def median(key: str) -> float | None:
        return median_of([r[key] for r in records if r.get(key) is not None])

    return {"mode": mode, "samples_per_s": samples / wall, "wall_s": wall, "steps": len(records),
            "trainer_idle_s": median("perf/rollout_wait_s"),
            "engine_idle_s": median("perf/engine_idle_s"),
            # where a step's time goes, medians: generation, training (log-probs included), weight sync, pause
            "rollout_s": median("rl/rollout_s"), "train_s": median("rl/train_s"),
            "log_probs_s": median("perf/log_probs_time"), "sync_s": median("rl/sync_s"),
            "pause_s": median("perf/pause_generation_s"),
            # a step's wall time, and what is left of it beyond waiting for the batch, training, pausing generation
            # and the weight sync: the loop's own cost (store reads and writes, Ray calls, resuming, logging)
            "step_s": median("bench/step_s"),
            "other_s": median_of([r["bench/step_s"] - sum(r.get(k) or 0.0 for k in STEP_PARTS) for r in records]),
            "max_staleness": max((r.get("async/staleness/max", 0) for r in records), default=0),
            "reward_mean": statistics.fmean(r.get("rl/reward_mean", 0.0) for r in records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "0.5b", "1.5b"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--max-lag", type=int, default=1, help="fully async: --max-policy-version-lag")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--share-gpu", action="store_true",
                        help="train rank and engine on one GPU, both resident (cluster.share_gpu), in every mode")
    parser.add_argument("--train-gpu-fraction", type=float, help="--share-gpu: the train rank's part (0.5)")
    parser.add_argument("--rollout-gpu-fraction", type=float, help="--share-gpu: the engine's part (0.5)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        scratch = Path(tmp)
        model_dir, prompts = workspace(args.model, scratch, torch.bfloat16 if cuda else torch.float32)
        for mode in args.modes.split(","):
            rows.append(run_mode(args, mode, model_dir, prompts, scratch / mode, cuda))
            print(json.dumps({"mode_done": rows[-1]}), flush=True)  # each mode's figures as soon as it ends
    base = next((r["samples_per_s"] for r in rows if r["mode"] == "off"), None)
    print(f"{'mode':<14}{'samples/s':>11}{'vs sync':>9}{'trainer idle':>14}{'engine idle':>13}{'max lag':>9}"
          f"{'reward':>8}")
    for r in rows:
        ratio = r["samples_per_s"] / base if base else float("nan")
        engine = "-" if r["engine_idle_s"] is None else f"{r['engine_idle_s']:.2f}"
        trainer = "-" if r["trainer_idle_s"] is None else f"{r['trainer_idle_s']:.2f}"
        print(f"{r['mode']:<14}{r['samples_per_s']:>11.2f}{ratio:>9.2f}{trainer:>14}{engine:>13}"
              f"{r['max_staleness']:>9}{r['reward_mean']:>8.3f}")
    sync = next((r for r in rows if r["mode"] == "off"), None)
    if sync and sync["rollout_s"] and sync["train_s"]:
        # overlap can at best hide the shorter of generating and training + weight sync (which stays on the
        # trainer's path): the ceiling of any async mode at sync's generation rate. Where generation is the longer
        # side, fully async can pass it: its window (K batches ahead) keeps more rows on the engine at once, and
        # an engine's tokens/s grows with its rows (measured on the CPU: 2.8x against a 1.5x "ceiling")
        generate, train = sync["rollout_s"], sync["train_s"] + (sync["sync_s"] or 0.0)
        ceiling = (generate + train) / max(generate, train)
        print(f"sync step: generate {sync['rollout_s']:.2f} s, train {sync['train_s']:.2f} s, weight sync "
              f"{sync['sync_s'] or 0:.2f} s: overlap ceiling {ceiling:.2f}x at sync's generation rate")
    print(json.dumps({"model": args.model, "device": "cuda" if cuda else "cpu", "share_gpu": args.share_gpu,
                      "rows": rows}))


if __name__ == "__main__":
    main()
