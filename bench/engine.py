"""Built-in engine throughput vs plain `transformers` generate on the same model.

Output tokens/s for N concurrent requests x M new tokens (sampling, temperature 1, EOS ignored so
every request produces exactly M tokens). The engine runs as its real HTTP server process and is
driven by N concurrent `/generate` calls through the rollout code's own client (`EngineClient`, kept
across runs as a rollout keeps its client, so connections are reused); the baseline is one batched
`model.generate` call on left-padded prompts in this process. Both are measured warm: one untimed warm-up run of each first,
whose time is reported separately. The two alternate within each repeat (A B A B ...), so drift of
a shared machine's speed hits both alike; the ratio is taken repeat by repeat.

    python bench/engine.py --model runs/tiny-kit/model                   # CPU, tiny kit
    python bench/engine.py --model DIR --device cuda --dtype bfloat16    # GPU
    python bench/engine.py ... --in-process   # also the engine without its HTTP server
    python bench/engine.py ... --split        # one JSON line: where the server's time went per run

`--split` reads the server's record of each timed run (/server_info's `busy_period`,
slime/engines/builtin/stats.py) and prints the median of each field over the runs (and a few fields
run by run, `per_run`, to see where a slow run lost its time), with the client's
run time (`client_s`) and three derived figures: `model_thread_other_s` (inside the period, neither
prefill nor decode: waiting for arrivals, compaction, handing replies over), `after_idle_s` (last
reply built after the model thread went idle) and `client_extra_s` (the client's run time beyond the
server's first-arrival-to-last-reply span: sending and receiving).

The benchmark's own process freezes its garbage collector (`gc.collect(); gc.freeze()`) once set-up and
the warm-up runs are done, as the server and the RL rollout manager do for their long-lived objects: before,
a full collection walking torch's and transformers' objects took 0.20 s of the client's time in 2 of 5
timed runs on an H200 (`client_gc_s`, still reported), so the runs timed the benchmark's collector, not the
engine. `--disable-sampler-compile` passes the engine's flag (the sampler's common path eager on CUDA) for
an A/B against the compiled default; `--disable-slot-prefill` likewise (prompts prefilled by the `transformers`
forward and copied into the slots, against the slot prefill); `--disable-fused-kv-write` likewise (the decode
step's rotary and two K/V cache writes as separate kernels, against the one compiled function).

Figures go to docs/benchmarks.md (command, machine, median of the repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime.data.random_models import QWEN2_SHAPES, save_random_qwen2
from slime.engines.builtin.launcher import start_builtin_engine
from slime.engines.client import EngineClient


def save_micro_qwen2(out_dir: Path, dtype: torch.dtype) -> Path:
    """A seeded 1-layer Qwen2 (hidden 64) over the tiny kit's tokenizer, written to `out_dir`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from slime.data.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # stay clear of special tokens at the top of the vocabulary
    return torch.randint(0, max(2, vocab - 8), (n, length), generator=generator).tolist()


def run_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int, device: str) -> float:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=pad_id, output_scores=True,
                             return_dict_in_generate=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out.sequences.shape[1] == width + new_tokens
    return elapsed


async def _post_all(client: EngineClient, url: str, prompts: list[list[int]], new_tokens: int,
                    start_at: float | None = None) -> tuple[float, float]:
    """POST every prompt concurrently through the rollout code's own client (`EngineClient`, replies
    decoded); the wall-clock times (time.time) the first request left and the last reply arrived.
    With `start_at`, the requests leave at that moment (client processes)."""
    body = {"return_logprob": True, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
    start = time.time()
    replies = await asyncio.gather(*[client.post(f"{url}/generate", {**body, "input_ids": p}) for p in prompts])
    end = time.time()
    assert all(reply["meta_info"]["completion_tokens"] == new_tokens for reply in replies)
    return start, end


def _new_client(connections: int) -> EngineClient:
    return EngineClient(max_connections=connections, max_retries=0, timeout_s=3600)


def _client_process(url: str, prompts: list[list[int]], new_tokens: int, start_at: float) -> float:
    async def run() -> float:
        async with _new_client(len(prompts)) as client:
            await client.get(f"{url}/health")  # connected before the common start
            return (await _post_all(client, url, prompts, new_tokens, start_at))[1]

    return asyncio.run(run())


class HttpDriver:
    """Drives the engine over HTTP as the rollout does: one `EngineClient` on one event loop for
    every run (slime.rollout.http keeps one per loop), so the connections the warm-up run opened are
    reused. With `workers` > 1 the requests are split over that many client processes instead, which
    start together, so the client's own Python (HTTP, JSON) is not one core's sequential work."""

    def __init__(self, url: str, connections: int, workers: int = 1) -> None:
        self.url, self.workers = url, workers
        self.pool = (ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
                     if workers > 1 else None)
        self.loop = asyncio.new_event_loop()
        self.client = _new_client(connections)

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Seconds from sending the first request to receiving the last reply."""
        if self.pool is None:
            start, end = self.loop.run_until_complete(_post_all(self.client, self.url, prompts, new_tokens))
            return end - start
        start_at = time.time() + 0.5  # every process has its client ready by then
        chunks = [prompts[i::self.workers] for i in range(self.workers)]
        ends = list(self.pool.map(_client_process, [self.url] * self.workers, chunks,
                                  [new_tokens] * self.workers, [start_at] * self.workers))
        return max(ends) - start_at

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()
        if self.pool is not None:
            self.pool.shutdown()


COUNTERS = ("steps", "prefills", "decodes_ahead")


def engine_counters(url: str) -> dict[str, int]:
    """The engine's own step, prefill-group and launched-ahead decode counts (/server_info)."""
    state = httpx.get(f"{url}/server_info", trust_env=False).json()["internal_states"][0]
    return {name: state.get(name, 0) for name in COUNTERS}


SPREAD = ("client_s", "last_arrival_at", "prefills", "first_decode_at", "decode_steps", "decode_s", "idle_at",
          "last_reply_at", "gc_full", "gc_s", "client_gc_s")


class ClientGC:
    """Seconds this (client) process spent in Python's garbage collector, as `client_gc_s` of --split."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def busy_period(url: str) -> dict[str, Any]:
    """The server's record of its last busy period (one run of the benchmark)."""
    state = httpx.get(f"{url}/server_info", trust_env=False).json()["internal_states"][0]
    return state["busy_period"]


def describe_split(periods: list[dict[str, Any]]) -> str:
    """One JSON line: the median of each numeric field of the runs' periods, plus derived figures."""
    for period in periods:
        if period["idle_at"] is None:  # read a moment before the model thread noticed it was idle
            period["idle_at"] = period["last_reply_at"]
        period["model_thread_other_s"] = period["idle_at"] - period["prefill_s"] - period["decode_s"]
        period["after_idle_s"] = (period["last_reply_at"] or period["idle_at"]) - period["idle_at"]
        period["client_extra_s"] = period["client_s"] - (period["last_reply_at"] or period["idle_at"])
    fields = [k for k, v in periods[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    medians = {k: round(statistics.median(p[k] for p in periods if p.get(k) is not None), 4) for k in fields}
    # the spread between runs, for the figures that say which phase a slow run lost its time in
    per_run = {k: [None if p.get(k) is None else round(p[k], 4) for p in periods] for k in SPREAD}
    return json.dumps({"split": medians, "runs": len(periods), "per_run": per_run})


def describe_counters(before: dict[str, int], after: dict[str, int], runs: int) -> str:
    return ", ".join(f"{(after[name] - before[name]) / runs:.1f} {name}" for name in COUNTERS)


async def run_engine_in_process(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """The same requests handed to an in-process engine: the engine's own cost, without HTTP."""
    body = {"return_logprob": True, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    start = time.perf_counter()
    replies = await asyncio.gather(*[engine.generate({**body, "input_ids": p}) for p in prompts])
    elapsed = time.perf_counter() - start
    assert all(r["meta_info"]["completion_tokens"] == new_tokens for r in replies)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="HF model directory")
    source.add_argument("--random-qwen2", choices=[*sorted(QWEN2_SHAPES), "micro"],
                        help="random weights of this shape (micro: 1 layer, hidden 64, the tiny tokenizer's "
                             "vocabulary: a nearly free forward, so a CPU run times the engine's host work)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--skip-generate", action="store_true", help="only the engine")
    parser.add_argument("--in-process", action="store_true",
                        help="also time the engine in this process (no HTTP server): the engine's own cost")
    parser.add_argument("--kv-cache", default="auto", choices=["auto", "slots", "dynamic"],
                        help="the engine's KV cache (auto: slots with CUDA graphs on CUDA)")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="engine: wait for each step's tokens before launching the next decode")
    parser.add_argument("--disable-fused-projections", action="store_true",
                        help="engine: q/k/v and gate/up as separate GEMMs in the decode step (the baseline)")
    parser.add_argument("--admission-window-ms", type=float,
                        help="engine: its admission window (default: the engine's, 10 ms)")
    parser.add_argument("--disable-gc-freeze", action="store_true",
                        help="engine: leave its garbage collector unfrozen (the baseline)")
    parser.add_argument("--disable-sampler-compile", action="store_true",
                        help="engine: sample eagerly on CUDA (the baseline of the compiled sampler)")
    parser.add_argument("--disable-slot-prefill", action="store_true",
                        help="engine: prefill by the transformers forward + a copy into the slots (the baseline)")
    parser.add_argument("--disable-fused-kv-write", action="store_true",
                        help="engine: the decode step's rotary and K/V cache writes unfused (the baseline)")
    parser.add_argument("--split", action="store_true",
                        help="print one JSON line: the server's split of each run's time (stats.py), medians")
    parser.add_argument("--client-procs", type=int, default=1,
                        help="HTTP client processes sharing the requests (1: the benchmark's own event loop)")
    args = parser.parse_args()

    scratch = tempfile.TemporaryDirectory()
    if args.random_qwen2 == "micro":
        args.model = str(save_micro_qwen2(Path(scratch.name) / "model", getattr(torch, args.dtype)))
    elif args.random_qwen2:
        args.model = str(save_random_qwen2(Path(scratch.name) / "model", args.random_qwen2, getattr(torch, args.dtype)))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = make_prompts(args.requests, args.prompt_len, len(tokenizer))
    tokens = args.requests * args.new_tokens
    print(f"{args.requests} concurrent requests x {args.new_tokens} new tokens, prompt {args.prompt_len} tokens, "
          f"{args.device} {args.dtype}, kv cache {args.kv_cache}, warm median of {args.repeats}")

    results: dict[str, tuple[float, list[float]]] = {}
    model = None
    if not args.skip_generate:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
        model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine_flags = [flag for flag, on in (("--disable-overlap-schedule", args.disable_overlap_schedule),
                                          ("--disable-fused-projections", args.disable_fused_projections),
                                          ("--disable-gc-freeze", args.disable_gc_freeze),
                                          ("--disable-sampler-compile", args.disable_sampler_compile),
                                          ("--disable-slot-prefill", args.disable_slot_prefill),
                                          ("--disable-fused-kv-write", args.disable_fused_kv_write)) if on]
    if args.admission_window_ms is not None:
        engine_flags += ["--admission-window-ms", str(args.admission_window_ms)]
    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_builtin_engine(args.model, log_path=Path(tmp) / "engine.log", device=args.device,
                                            dtype=args.dtype, max_running_requests=max(256, args.requests),
                                            kv_cache=args.kv_cache,
                                            extra_args=engine_flags)
        driver = HttpDriver(url, len(prompts), args.client_procs)
        try:
            engine_times, generate_times = [], []
            engine_warm = driver.run(prompts, args.new_tokens)
            generate_warm = run_generate(model, prompts, args.new_tokens, pad, args.device) if model else 0.0
            # set-up and warm-up done: what exists now lives to the end, so full collections stop walking it
            # (a 0.20 s client collection was in 2 of 5 timed H200 runs before; `client_gc_s` still says)
            gc.collect()
            gc.freeze()
            before = engine_counters(url)
            periods = []
            client_gc = ClientGC() if args.split else None
            for _ in range(args.repeats):
                if client_gc is not None:
                    client_gc.take()
                engine_times.append(driver.run(prompts, args.new_tokens))
                if client_gc is not None:
                    periods.append({**busy_period(url), "client_s": engine_times[-1], "client_gc_s": client_gc.take()})
                if model is not None:
                    generate_times.append(run_generate(model, prompts, args.new_tokens, pad, args.device))
            after = engine_counters(url)
        finally:
            driver.close()
            process.stop()
    print(f"engine over HTTP, per timed run: {describe_counters(before, after, args.repeats)}; "
          f"{args.client_procs} client process(es)")
    if args.split:
        print(describe_split(periods))
    results["built-in engine (HTTP)"] = (engine_warm, engine_times)
    if args.in_process:
        from slime.engines.builtin.engine import BuiltinEngine, EngineArgs

        engine = BuiltinEngine(EngineArgs(model_path=args.model, device=args.device, dtype=args.dtype,
                                          max_running_requests=max(256, args.requests), kv_cache=args.kv_cache,
                                          disable_overlap_schedule=args.disable_overlap_schedule,
                                          disable_fused_projections=args.disable_fused_projections,
                                          disable_sampler_compile=args.disable_sampler_compile,
                                          disable_slot_prefill=args.disable_slot_prefill,
                                          disable_fused_kv_write=args.disable_fused_kv_write))
        try:
            warm = asyncio.run(run_engine_in_process(engine, prompts, args.new_tokens))
            gc.collect()  # the in-process engine's objects too, as its server process does at start
            gc.freeze()
            scheduler = engine.scheduler
            before = {name: getattr(scheduler, name) for name in COUNTERS}
            times = [asyncio.run(run_engine_in_process(engine, prompts, args.new_tokens)) for _ in range(args.repeats)]
            after = {name: getattr(scheduler, name) for name in COUNTERS}
            print(f"engine in process, per timed run: {describe_counters(before, after, args.repeats)}")
        finally:
            engine.shutdown()
        results["built-in engine (in process)"] = (warm, times)
    scratch.cleanup()
    if generate_times:
        results["transformers generate"] = (generate_warm, generate_times)

    for name, (warm, times) in results.items():
        median = statistics.median(times)
        print(f"{name:30s} {tokens / median:10.0f} tok/s  (median {median:.2f} s, min {min(times):.2f}, "
              f"max {max(times):.2f}; warm-up run {warm:.2f} s)")
    if generate_times:
        ratios = [g / e for g, e in zip(generate_times, engine_times, strict=True)]
        print(f"engine speed / generate speed, per repeat: median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
