"""Generation throughput of fully async training while an eval runs, against none running.

    python bench/eval_beside_async.py --window 30                 # CPU, the tiny kit
    python bench/eval_beside_async.py --window 30 --modes none,fleet

The training side is `slime.rollout.fully_async.FullyAsyncRollout` on one built-in engine behind the real
sglang-router, driven as the RL loop drives it with a trainer that takes no time: take a batch, pause, move the
engines' version label on, resume (the weights do not change: what is measured is the engine's generation). Over
a window of `--window` seconds the response tokens of the training generation are counted (tokens/s), with:

    none     no eval
    fleet    evals back to back on an eval engine of its own behind its own router (`cluster.eval_num_gpus`:
             what the RL loop does in fully async mode with an eval fleet)
    shared   evals back to back on the training engine itself, through its router (`eval_num_gpus 0`: the
             eval requests interleave with the training ones on the same engine)

Also reported: eval samples per second, the generator's pauses in the window (one per batch here: the
version move; an eval adds none) and the engine idle time. On a CPU the eval engine of `fleet` shares the
cores with the training engine, so `fleet` measures CPU contention, not a separate device's; on GPUs the fleet
has GPUs of its own. Prints one JSON line per mode and a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from slime.config import Config
from slime.data.source import RolloutDataSource
from slime.data.tiny import TinyKitRecipe, make_datasets, make_tiny_kit
from slime.engines.fleet import serve_policy
from slime.rollout import generate_rollout, rollout_args
from slime.rollout.fully_async import FullyAsyncRollout

MODES = ("none", "fleet", "shared")


def make_config(model_dir: str, prompts: str, eval_prompts: str, args: argparse.Namespace) -> Config:
    return Config.model_validate({
        "run": {"seed": 1},
        "checkpoint": {"hf_checkpoint": model_dir},
        "data": {"prompt_data": prompts},
        "rollout": {"rollout_batch_size": args.prompts, "n_samples_per_prompt": args.samples,
                    "rollout_max_response_len": args.max_new_tokens, "rollout_temperature": 1.0,
                    "partial_rollout": True},
        "eval": {"eval_prompt_data": {"arith": f"{eval_prompts}@[0:{args.eval_prompts}]"},
                 "eval_max_response_len": args.max_new_tokens, "n_samples_per_eval_prompt": 1},
        # a constant reward by dotted path (this file is importable by name: bench/ is the script's sys.path[0]):
        # the cost measured is generation's, and math_verify's grading process hung this bench under heavy load
        "reward": {"custom_rm_path": "eval_beside_async.rm_zero"},
        "sync": {"async_mode": "fully"},
    })


async def rm_zero(args: Any, sample: Any) -> float:
    """slime's custom reward signature; the reward does not matter here."""
    return 0.0


def eval_loop(config: Config, router: Any, stop: threading.Event, done: list[int]) -> None:
    """Evals back to back against `router` until `stop` is set; `done[0]` counts the eval samples. A thread of
    this process (the RL loop's eval fleet is a process of its own: this shares the GIL with the generator,
    which makes `fleet` and `shared` pessimistic alike)."""
    args = rollout_args(config, router)
    args.run_id = None  # nothing written to a store
    version = 0
    while not stop.is_set():
        out = generate_rollout(args, version, None, evaluation=True)
        done[0] += sum(int(v) for k, v in out.metrics.items() if k.endswith("/samples"))
        version += 1


def measure(config: Config, train_router: Any, eval_router: Any | None, window: float, warmup: float) -> dict[str, Any]:
    """Tokens/s of the training generation over `window` seconds after `warmup`, with evals against
    `eval_router` meanwhile (None: none)."""
    args = rollout_args(config, train_router)
    source = RolloutDataSource.from_config(config)
    # no bound: the engines' version label never moves here (nothing is synced), so under a bound every batch
    # after the second would be stale; the window still keeps generation one batch ahead
    gen = FullyAsyncRollout(args, source, batch_groups=config.rollout.rollout_batch_size, max_lag=None, partial=True)
    stop, done = threading.Event(), [0]
    child = None
    if eval_router is not None:
        child = threading.Thread(target=eval_loop, args=(config, eval_router, stop, done), daemon=True)
        child.start()
    tokens, batches, pauses, idle = 0, 0, 0, 0.0
    gen.start()
    try:
        t0 = time.monotonic()
        rollout_id, started = 0, None
        while True:
            now = time.monotonic()
            if started is None and now - t0 >= warmup:
                started, samples0 = now, done[0]
            if started is not None and now - started >= window:
                break
            _, _, metrics = gen.take_batch(rollout_id, timeout=600)
            gen.pause()
            gen.resume(rollout_id + 1)  # a sync that changes nothing but the version
            if started is not None:
                tokens += metrics["rollout/new_tokens"]
                batches += 1
                pauses += metrics["async/generation_pauses"]
                idle += metrics["perf/engine_idle_s"]
            rollout_id += 1
        elapsed = time.monotonic() - started
        eval_samples = done[0] - samples0
    finally:
        stop.set()
        gen.stop()
        if child is not None:
            child.join(timeout=600)
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "batches": batches, "window_s": elapsed,
            "pauses_per_batch": pauses / max(batches, 1), "engine_idle_s": idle,
            "eval_samples_per_s": eval_samples / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured per mode")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--eval-prompts", type=int, default=50)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="slime-bench-eval-") as tmp:
        scratch = Path(tmp)
        kit = make_tiny_kit(scratch / "kit")
        rows = make_datasets(TinyKitRecipe())
        prompts, eval_prompts = scratch / "train.jsonl", scratch / "eval.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows["train"]))
        eval_prompts.write_text("".join(json.dumps(r) + "\n" for r in rows["eval"]))
        config = make_config(str(kit.model_dir), str(prompts), str(eval_prompts), args)
        results = {}
        with serve_policy(config, str(kit.model_dir), scratch / "train-logs", 1) as train_router, \
                serve_policy(config, str(kit.model_dir), scratch / "eval-logs", 1) as eval_router:
            for mode in modes:
                target = {"none": None, "fleet": eval_router, "shared": train_router}[mode]
                results[mode] = measure(config, train_router, target, args.window, args.warmup)
                print(json.dumps({"mode": mode, **results[mode]}), flush=True)
    base = results.get("none", {}).get("tokens_per_s")
    print(f"\n{'mode':8} {'gen tok/s':>10} {'vs none':>8} {'eval samples/s':>15} {'pauses/batch':>13} {'batches':>8}")
    for mode, r in results.items():
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{mode:8} {r['tokens_per_s']:10.1f} {ratio:>8} {r['eval_samples_per_s']:15.2f} "
              f"{r['pauses_per_batch']:13.2f} {r['batches']:8d}")


if __name__ == "__main__":
    main()
