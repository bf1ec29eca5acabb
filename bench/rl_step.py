"""One RL iteration, taken apart: rollout, log-prob recompute, train, offload/onload, sync, and the rest.

    python bench/rl_step.py --model 0.5b --prompts 32 --samples 8 --max-new-tokens 1024     # one GPU, colocated
    python bench/rl_step.py --model tiny --prompts 4 --samples 4 --max-new-tokens 16        # CPU plumbing check

Drives `slime.rl.RLLoop` (Ray, the train group, the rollout manager with a built-in engine behind the real
sglang-router) directly, without Prefect, for `--warmup` + `--iterations` GRPO steps on a random-weight
model (`0.5b`/`1.5b`: Qwen2.5 shapes with the real 151,936-token vocabulary, so responses run to
`--max-new-tokens`; `tiny`: the tiny kit's model), colocated on one GPU by default (engine released while
Megatron trains, tensor sync). For each measured iteration it reads the step's metrics and the driver's
own timing of each loop call:

    rollout        generation of prompts x samples (rollout/time_s)
    engine off/on  the engine releasing its memory after the rollout and taking it back before the sync
    log-probs      recompute of the old (and reference) policy's log-probs (perf/log_probs_time)
    train          the optimizer steps and reading the shards (perf/train_time minus log-probs)
    train on/off   the trainer taking its weights and optimizer state back before training and
                   parking them after the sync (perf/onload_train_time, perf/offload_train_time)
    sync           the weight sync (sync/total_s)
    calls          the train and sync calls beyond all of the above: Ray round trips, the engines'
                   weight-update bracket (pause, version)
    rest           the iteration's wall time minus all of the above (the loop's own work, metrics line)

and the iteration's ratio to rollout + log-probs + train + sync. Prefect's share is measured by the rl
flow itself (`prefect_s`, docs/benchmarks.md). Prints a table of medians and one JSON line.
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

from slime.config import Config
from slime.data.random_models import QWEN2_SHAPES, save_random_qwen2
from slime.data.tiny import TinyKitRecipe, make_datasets, make_tiny_kit
from slime.rl import RLLoop

PARTS = ("rollout", "engine_offload", "engine_onload", "log_probs", "train", "train_onload", "train_offload",
         "sync", "calls", "rest")


def workspace(model: str, scratch: Path, dtype: torch.dtype) -> tuple[str, str]:
    """(HF model dir, prompt JSONL) for `model` under `scratch`; prompts are the tiny kit's arithmetic ones."""
    prompts = scratch / "prompts.jsonl"
    rows = make_datasets(TinyKitRecipe())["train"]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if model == "tiny":
        return str(make_tiny_kit(scratch / "kit").model_dir), str(prompts)
    return str(save_random_qwen2(scratch / model, model, dtype)), str(prompts)


def build_config(args: argparse.Namespace, model_dir: str, prompts: str, store: str, cuda: bool) -> Config:
    n = args.prompts * args.samples
    return Config.model_validate({
        "run": {"store": store, "run_id": "rl-step", "seed": 1},
        "cluster": {"colocate": args.colocate},
        "checkpoint": {"hf_checkpoint": model_dir},
        "data": {"prompt_data": prompts, "apply_chat_template": True},
        "rollout": {"rollout_batch_size": args.prompts, "n_samples_per_prompt": args.samples,
                    "num_rollout": args.warmup + args.iterations, "rollout_max_response_len": args.max_new_tokens,
                    "rollout_temperature": 1.0},
        "reward": {"rm_type": "math_verify"},
        "algorithm": {"advantage_estimator": "grpo"},
        "train": {"global_batch_size": n, "micro_batch_size": args.micro_batch_size,
                  "use_dynamic_batch_size": args.max_tokens_per_gpu is not None,
                  "max_tokens_per_gpu": args.max_tokens_per_gpu, "lr": 1e-6},
        "megatron": {"bf16": cuda},
    })


def breakdown(record: dict[str, Any], calls: dict[str, float]) -> dict[str, float]:
    """The parts of one iteration (seconds) from its metrics record and the driver's call timings."""
    log_probs = record.get("perf/log_probs_time", 0.0)
    train_time = record.get("perf/train_time", 0.0)
    sync = record.get("sync/total_s", 0.0)
    onload = record.get("perf/onload_rollout_time", 0.0)
    train_onload = record.get("perf/onload_train_time", 0.0)
    train_offload = record.get("perf/offload_train_time", 0.0)
    parts = {
        "rollout": record.get("rollout/time_s", 0.0),
        "engine_offload": record.get("perf/offload_rollout_time", 0.0),
        "engine_onload": onload,
        "log_probs": log_probs,
        "train": train_time - log_probs,
        "train_onload": train_onload,
        "train_offload": train_offload,
        "sync": sync,
        "calls": calls["train"] - train_time - train_onload + calls["sync"] - sync - onload - train_offload,
    }
    parts["rest"] = calls["wall"] - sum(parts.values())
    parts["wall"] = calls["wall"]
    parts["ratio_to_work"] = calls["wall"] / max(parts["rollout"] + log_probs + parts["train"] + sync, 1e-9)
    parts["rollout_tokens_per_s"] = record.get("rollout/tokens_per_s", 0.0)
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b", choices=["tiny", *QWEN2_SHAPES])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--max-tokens-per-gpu", type=int, default=None, help="dynamic batching by tokens when set")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--colocate", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--scratch", type=Path, default=None, help="work dir (default: a temporary one)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="slime-rl-step-"))
    scratch.mkdir(parents=True, exist_ok=True)
    model_dir, prompts = workspace(args.model, scratch, torch.bfloat16 if cuda else torch.float32)
    config = build_config(args, model_dir, prompts, str(scratch / "store"), cuda)
    loop = RLLoop(config)
    rows = []
    try:
        setup = loop.setup()
        for rollout_id in range(loop.num_rollout):
            t0 = time.perf_counter()
            uri = loop.rollout(rollout_id)["uri"]
            t1 = time.perf_counter()
            loop.train(rollout_id, uri)
            t2 = time.perf_counter()
            loop.sync(rollout_id)
            t3 = time.perf_counter()
            record = loop.log_step(rollout_id)
            calls = {"train": t2 - t1, "sync": t3 - t2, "wall": time.perf_counter() - t0}
            if rollout_id >= args.warmup:
                rows.append(breakdown(record, calls))
    finally:
        loop.close()

    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"\n{args.model}, {args.prompts} prompts x {args.samples} samples, up to {args.max_new_tokens} new tokens, "
          f"{'colocated' if args.colocate else 'decoupled'}, {'cuda' if cuda else 'cpu'}; setup "
          f"{setup['setup_s']:.1f} s; median of {len(rows)} iterations after {args.warmup} warm-up")
    for part in PARTS:
        print(f"  {part:<16}{median[part]:8.3f} s")
    print(f"  {'iteration':<16}{median['wall']:8.3f} s   {median['ratio_to_work']:.2f}x rollout + log-probs + train "
          f"+ sync; rollout {median['rollout_tokens_per_s']:,.0f} tok/s")
    print(json.dumps({"model": args.model, "prompts": args.prompts, "samples": args.samples,
                      "max_new_tokens": args.max_new_tokens, "colocate": args.colocate, "cuda": cuda,
                      "setup_s": setup["setup_s"], "median": median, "iterations": rows}))


if __name__ == "__main__":
    main()
