"""Built-in engine throughput with tensor parallelism: `--tp-size 1` against `--tp-size N` on one model.

Output tokens/s for R concurrent requests x M new tokens (sampling, temperature 1, EOS ignored), each engine as its
real HTTP server process driven through the rollout code's own client (`EngineClient`), measured warm: one untimed
warm-up run per engine (CUDA graph capture, compilation; its time reported separately), then `--repeats` timed runs,
median reported. Both engines on the slot KV cache (TP needs it; on CUDA it is the default anyway), one after the
other (the GPUs are not shared between them). The default model is a random Qwen2.5-14B shape in bf16
(`slime.data.random_models`, 29.5 GB: TP 1 fits one 80 GB GPU; building it takes ~60 GB of host memory once),
written once to `--workdir`.

    python bench/engine_tp.py --device cuda --tp 2                      # 14B shape, TP 1 vs TP 2 (two GPUs)
    python bench/engine_tp.py --random-qwen2 0.5b --tp 2 --requests 64  # quicker
    python bench/engine_tp.py --model DIR --device cpu --dtype float32 --tp 2 --requests 4 --new-tokens 16

What TP should change at decode sizes: each rank reads 1/N of the attention and MLP weights per step (the decode step
is bound by weight reads at small batches), plus two all-reduces of [batch, hidden] per layer; the embeddings and
the lm_head (V x H, 0.78 G parameters at 14B) are replicated, so every rank reads all of the lm_head each step.
One JSON line per engine: {"tp", "tok_per_s", "runs_s", "warmup_s", "start_s"}, then the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slime.data.random_models import QWEN2_SHAPES, save_random_qwen2  # noqa: E402
from slime.engines.builtin.launcher import start_builtin_engine  # noqa: E402
from slime.engines.client import EngineClient  # noqa: E402


async def run_once(client: EngineClient, url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds from the first request sent to the last reply received."""
    body = {"sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}}
    start = time.perf_counter()
    replies = await asyncio.gather(*[client.post(f"{url}/generate", {**body, "input_ids": p}) for p in prompts])
    elapsed = time.perf_counter() - start
    assert all(r["meta_info"]["completion_tokens"] == new_tokens for r in replies)
    return elapsed


def bench_engine(model: str, tp: int, args: argparse.Namespace, prompts: list[list[int]], log: Path) -> dict:
    started = time.perf_counter()
    extra = ["--tp-size", str(tp), "--max-running-requests", str(max(args.requests, 1))]
    server, url = start_builtin_engine(model, log_path=log, device=args.device, dtype=args.dtype, kv_cache="slots",
                                       timeout_s=args.start_timeout_s, extra_args=extra)
    start_s = time.perf_counter() - started
    loop = asyncio.new_event_loop()
    client = EngineClient(max_connections=len(prompts), max_retries=0, timeout_s=3600)
    try:
        warmup = loop.run_until_complete(run_once(client, url, prompts, args.new_tokens))
        runs = [loop.run_until_complete(run_once(client, url, prompts, args.new_tokens)) for _ in range(args.repeats)]
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
        server.stop(timeout_s=60)
    median = statistics.median(runs)
    return {"tp": tp, "tok_per_s": round(len(prompts) * args.new_tokens / median, 1),
            "runs_s": [round(r, 3) for r in runs], "warmup_s": round(warmup, 2), "start_s": round(start_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF model directory (default: a random Qwen2 of --random-qwen2's shape)")
    source.add_argument("--random-qwen2", default="14b", choices=sorted(QWEN2_SHAPES))
    parser.add_argument("--workdir", default="runs/bench-engine-tp", help="where the random model is written")
    parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with 1")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--start-timeout-s", type=float, default=900.0)
    args = parser.parse_args()

    model = args.model
    if model is None:
        path = Path(args.workdir) / f"qwen2-{args.random_qwen2}-{args.dtype}"
        if not (path / "config.json").exists():
            save_random_qwen2(path, args.random_qwen2, dtype=getattr(torch, args.dtype))
        model = str(path)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 200, (args.requests, args.prompt_len), generator=generator).tolist()
    results = []
    for tp in (1, args.tp):
        results.append(bench_engine(model, tp, args, prompts, Path(args.workdir) / f"engine-tp{tp}.log"))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"model": model, "requests": args.requests, "new_tokens": args.new_tokens,
                      f"tp{args.tp}_over_tp1": round(results[1]["tok_per_s"] / results[0]["tok_per_s"], 3)}))


if __name__ == "__main__":
    main()
