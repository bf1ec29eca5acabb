"""Rollout-layer overhead: a full `generate_rollout` step vs the same requests sent straight to the engines.

Two built-in engines behind the real sglang-router serve the tiny kit's model (CPU by default). Each
repeat runs, alternating (A B A B ...) so drift of a shared machine hits both alike:

* rollout: `slime.rollout.generate_rollout` for `--batch` groups x `--n` samples, `--max-new` tokens,
  through the router, scored (`--rm-type`, default math_verify) and written as a shard set to a temp store;
* raw: the same prompt token ids and sampling params posted concurrently to the engines directly
  (round robin over the two engine URLs), nothing else.

Output: samples/s and tokens/s of each (median over `--repeats`, after one untimed warm-up of each)
and the overhead `1 - rollout tokens/s / raw tokens/s`, taken repeat by repeat. On a shared, loaded
machine wall-clock figures swing by 2-3x between repeats, so CPU time is reported too (psutil, this
process alone, the router and the engines with their children): the rollout layer's extra CPU seconds (driver +
router, minus what the raw driver spends) per engine CPU second. On a CPU-bound machine that extra CPU
is taken from the engines, so it bounds the throughput the layer costs, independently of other load.

    python bench/rollout.py --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from slime.config import FIELD_SECTION, Config
from slime.data.prompts import load_prompts
from slime.data.source import RolloutDataSource
from slime.data.tiny import make_tiny_kit
from slime.engines.builtin.launcher import start_builtin_engine
from slime.engines.client import EngineClient
from slime.engines.router import SGLangRouter
from slime.rollout import generate_rollout, rollout_args
from slime.rollout.generate import load_tokenizer, sampling_params_from_args


def make_args(kit, router, store: str, opts: argparse.Namespace):
    fields = {"hf_checkpoint": str(kit.model_dir), "rollout_batch_size": opts.batch, "n_samples_per_prompt": opts.n,
              "rollout_max_response_len": opts.max_new, "rm_type": opts.rm_type, "store": store, "run_id": "bench"}
    nested: dict = {}
    for name, value in fields.items():
        nested.setdefault(FIELD_SECTION[name], {})[name] = value
    return rollout_args(Config.model_validate(nested), router)


def cpu_seconds(pid: int, children: bool = True) -> float:
    """User + system CPU seconds of a process (threads included) and, if asked, its children."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *(proc.children(recursive=True) if children else [])]:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class CpuMeter:
    """CPU seconds spent by the driver (this process), the router and the engines during a block."""

    def __init__(self, router_pid: int, engine_pids: list[int]) -> None:
        self.pids = {"driver": [psutil.Process().pid], "router": [router_pid], "engines": engine_pids}

    def snapshot(self) -> dict[str, float]:
        # the engines and the router are this process's children: count the driver alone
        return {k: sum(cpu_seconds(p, children=k != "driver") for p in pids) for k, pids in self.pids.items()}

    def measure(self, fn):
        before = self.snapshot()
        result = fn()
        after = self.snapshot()
        return result, {k: after[k] - before[k] for k in after}


def run_rollout(args, data_source, rollout_id: int) -> tuple[float, int, int]:
    started = time.perf_counter()
    out = generate_rollout(args, rollout_id, data_source)
    elapsed = time.perf_counter() - started
    return elapsed, out.metrics["rollout/samples"], out.metrics["rollout/new_tokens"]


async def run_raw(urls: list[str], prompts: list[list[int]], params: dict) -> tuple[float, int, int]:
    started = time.perf_counter()
    async with EngineClient() as client:
        outs = await asyncio.gather(*(
            client.post(f"{urls[i % len(urls)]}/generate",
                        {"input_ids": p, "sampling_params": dict(params), "return_logprob": True})
            for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - started
    return elapsed, len(outs), sum(len(o["output_ids"]) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kit", default=None, help="tiny kit directory (built in a temp dir when omitted)")
    parser.add_argument("--batch", type=int, default=16, help="groups per rollout step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new", type=int, default=32, help="rollout_max_response_len")
    parser.add_argument("--rm-type", default="math_verify")
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    kit = make_tiny_kit(Path(opts.kit) if opts.kit else tmp / "kit")
    engines = [start_builtin_engine(str(kit.model_dir), log_path=tmp / f"engine{i}.log", random_seed=i)
               for i in range(2)]
    router = SGLangRouter(worker_urls=[u for _, u in engines], log_path=tmp / "router.log").start()
    try:
        router.wait_workers_healthy(2)
        args = make_args(kit, router, str(tmp / "store"), opts)
        tokenizer = load_tokenizer(str(kit.model_dir))
        params = sampling_params_from_args(args)
        data_source = RolloutDataSource(load_prompts(str(kit.train)), n_samples_per_prompt=opts.n, args=args)
        # raw requests mirror a rollout step: the same number of prompts, each repeated n times
        raw_source = RolloutDataSource(load_prompts(str(kit.train)), n_samples_per_prompt=opts.n, args=args)
        urls = [u for _, u in engines]

        def raw_prompts() -> list[list[int]]:
            groups = raw_source.get_samples(opts.batch)
            return [tokenizer.encode(s.prompt, add_special_tokens=False) for g in groups for s in g]

        meter = CpuMeter(router.process.pid, [p.pid for p, _ in engines])
        warm_r = run_rollout(args, data_source, 0)
        warm_w = asyncio.run(run_raw(urls, raw_prompts(), params))
        print(f"warm-up: rollout {warm_r[0]:.2f} s, raw {warm_w[0]:.2f} s")
        rows, cpu = [], []
        for repeat in range(opts.repeats):
            r, r_cpu = meter.measure(lambda repeat=repeat: run_rollout(args, data_source, repeat + 1))
            w, w_cpu = meter.measure(lambda: asyncio.run(run_raw(urls, raw_prompts(), params)))
            rows.append((r, w))
            # extra CPU of the rollout layer per engine CPU second (engine CPU of the raw run as the base)
            extra = (r_cpu["driver"] + r_cpu["router"]) - (w_cpu["driver"] + w_cpu["router"])
            cpu.append((extra / w_cpu["engines"], r_cpu, w_cpu))
            print(f"repeat {repeat}: rollout {r[1] / r[0]:.1f} samples/s {r[2] / r[0]:.0f} tok/s ({r[2]} tokens); "
                  f"raw {w[1] / w[0]:.1f} samples/s {w[2] / w[0]:.0f} tok/s ({w[2]} tokens); CPU s rollout "
                  f"driver {r_cpu['driver']:.2f} router {r_cpu['router']:.2f} engines {r_cpu['engines']:.2f}, raw "
                  f"driver {w_cpu['driver']:.2f} router {w_cpu['router']:.2f} engines {w_cpu['engines']:.2f}")
        med = statistics.median
        r_sps, r_tps = med(r[1] / r[0] for r, _ in rows), med(r[2] / r[0] for r, _ in rows)
        w_sps, w_tps = med(w[1] / w[0] for _, w in rows), med(w[2] / w[0] for _, w in rows)
        overhead = med(1 - (r[2] / r[0]) / (w[2] / w[0]) for r, w in rows)
        print(f"\n{opts.batch} groups x {opts.n} samples x {opts.max_new} tokens, median of {opts.repeats}:")
        print(f"rollout (router + reward {opts.rm_type} + shard set): {r_sps:.1f} samples/s, {r_tps:.0f} tokens/s")
        print(f"raw engines:                                     {w_sps:.1f} samples/s, {w_tps:.0f} tokens/s")
        print(f"rollout-layer overhead (tokens/s): {overhead * 100:.1f}%")
        print(f"rollout-layer CPU overhead (extra driver+router CPU / engine CPU): "
              f"{med(c[0] for c in cpu) * 100:.1f}%  (rollout driver {med(c[1]['driver'] for c in cpu):.2f} s, "
              f"router {med(c[1]['router'] for c in cpu):.2f} s; raw driver {med(c[2]['driver'] for c in cpu):.2f} s; "
              f"engines {med(c[2]['engines'] for c in cpu):.2f} s per step)")
    finally:
        router.stop()
        for process, _ in engines:
            process.stop()


if __name__ == "__main__":
    main()
