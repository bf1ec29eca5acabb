"""The built-in engine's replayed decode graph alone, with and without fused projections, in one process.

One random-weight Qwen2 of the given shape (bf16, CUDA) with its q/k/v and gate/up projections fused
(`slime/engines/builtin/fusion.py`: the modules' parameters are views into the fused buffers, so both
decoders below read the same weights); two slot decoders over it, one running the modules' five GEMMs per
layer (`projections=None`, what `--disable-fused-projections` runs), one the two fused GEMMs. Keys and values
random, every row at position 200 (length bucket 256, as the figures in docs/engines.md). For each batch size
the graph of that bucket is replayed `--steps` times, timed by CUDA events (median per round), the two decoders
alternating for `--rounds` rounds; printed: the median of the rounds' medians, and the largest logit gap
between the two (a sanity check: the same weights, another GEMM split, bf16). CUDA only.

Both decoders run the decode step's rotary + key/value cache writes as one compiled function (the default:
`slots.rotate_write_kv_fn`); a third, with fused projections and `fuse_kv_write=False` (what
`--disable-fused-kv-write` runs on the engine: the compiled rotary, then two `index_put_`), is timed alongside,
and the line ends with its step time and the fused K/V write's saving against it. `--disable-fused-kv-write`
here builds the first two without it and skips the third (the figures before it existed).

    python bench/decode_step.py --random-qwen2 0.5b --batches 64 256
    python bench/decode_step.py --random-qwen2 0.5b --batches 256 --profile 30   # + the kernels of one replay

`--sampler` also times the sampler (`slime.engines.builtin.sampling.sample`, temperature 1, no top-k/top-p: the RL
case) on each batch's logits, eager (what `--disable-sampler-compile` runs) and compiled (`compiled_draw`, the CUDA
default), alternating for `--rounds` rounds: median milliseconds of one call from its launch to the end of its
GPU work (CUDA events, so host launch gaps count), how many rows drew another token from the same uniform (0
expected), and the largest log-prob gap.

    python bench/decode_step.py --random-qwen2 0.5b --batches 64 256 --sampler

`--prefill` times the prompt prefill instead (`slime/engines/builtin/slots.py`, `SlotDecoder.prefill`): for B
prompts of `--prompt-len` random tokens at each B in `--batches`, the `transformers` forward over a DynamicCache
followed by `write_prefill` (what `--disable-slot-prefill` runs, as the scheduler does it: left-padded ids built on
the host, mask left out when there is no padding) against the slot prefill (the slot decoder's layers writing the
slots directly), `--prefill-steps` calls each, alternating for `--rounds` rounds, CUDA events from launch to the end
of the GPU work (host launch gaps count); printed: the median of the rounds' medians, the largest |logit gap| of
the last position and the largest |key/value gap| over the prompts' slot positions, with whether the two caches
match (within 1e-5 in fp32, 2e-2 in bf16/fp16: the fused GEMMs split the work differently).

    python bench/decode_step.py --random-qwen2 0.5b --batches 64 256 --prefill
    python bench/decode_step.py --random-qwen2 micro --device cpu --dtype float32 --batches 4 --prefill  # smoke

`--profile ROWS` then replays the fused decoder's graph of each batch once under torch.profiler and prints the
step's GPU time, its kernel count and the ROWS costliest kernels: what a replayed step is made of (a 0.5B step
at 256 rows was 2.36 ms against a ~0.7 ms memory floor: kernel count, not bytes, is the suspect).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from profiling import print_profile
from transformers import AutoModelForCausalLM, DynamicCache

from slime.data.random_models import QWEN2_SHAPES, save_random_qwen2
from slime.engines.builtin.batch import left_padded, transformers_forward
from slime.engines.builtin.fusion import ProjectionFusion
from slime.engines.builtin.sampling import sample
from slime.engines.builtin.slots import SlotDecoder


def call_ms(fn, steps: int, warmup: int = 10) -> float:
    """Median milliseconds of one call of `fn`, from its launch to the end of its GPU work (CUDA events);
    without CUDA (a smoke run of --prefill on the CPU) the wall time of each call."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def compare_sampler(logits: torch.Tensor, steps: int, rounds: int) -> str:
    """The sampler eager vs compiled on the same logits and uniforms: times, same tokens, log-prob gap."""
    batch = logits.shape[0]
    # host tensors, as the scheduler builds them: `sample` decides top-k/top-p on the host, then copies them
    params = (torch.ones(batch), torch.ones(batch), torch.full((batch,), -1, dtype=torch.long),
              torch.rand(batch, dtype=torch.float64, generator=torch.Generator().manual_seed(batch)))
    ways = {"eager": False, "compiled": True}
    drawn = {name: sample(logits, *params, compiled=on) for name, on in ways.items()}  # compiles once
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, on in ways.items():
            times[name].append(call_ms(lambda on=on: sample(logits, *params, compiled=on), steps))
    eager, compiled = (statistics.median(times[n]) for n in ways)
    differ = int((drawn["eager"][0] != drawn["compiled"][0]).sum())  # 0 expected (docs/engines.md: numerics)
    gap = (drawn["eager"][1] - drawn["compiled"][1]).abs().max().item()
    return (f"sampler: eager {eager:.3f} ms, compiled {compiled:.3f} ms ({(eager - compiled) / eager:+.1%}); "
            f"tokens differing {differ} of {batch}, max |log-prob gap| {gap:.3g}")


def hf_prefill(model, decoder: SlotDecoder, prompts: list[list[int]]) -> torch.Tensor:
    """The `transformers` prefill as the scheduler runs it with --disable-slot-prefill (its `left_padded` and
    `transformers_forward`), then `write_prefill` into slots 0 .. B-1; the last position's logits."""
    ids, mask, positions = left_padded(prompts, decoder.device)
    cache = DynamicCache(config=model.config)
    logits = transformers_forward(model, ids, mask, positions, cache)
    decoder.write_prefill(cache, list(range(len(prompts))), [len(p) for p in prompts], first_slot=0)
    return logits


def compare_prefill(model, fusion: ProjectionFusion, args: argparse.Namespace, device: torch.device) -> None:
    """The HF prefill + write_prefill against the slot prefill, per batch size (see the module docstring)."""
    exact = next(model.parameters()).dtype == torch.float32
    tolerance = 1e-5
    for batch in args.batches:
        prompts = torch.randint(0, max(2, model.config.vocab_size - 8), (batch, args.prompt_len),
                                generator=torch.Generator().manual_seed(batch)).tolist()
        decoders = {name: SlotDecoder(model, slots=batch, max_len=args.prompt_len, device=device,
                                      cuda_graphs=device.type == "cuda", projections=fusion)
                    for name in ("hf", "slot")}
        calls = {"hf": functools.partial(hf_prefill, model, decoders["hf"], prompts),
                 "slot": functools.partial(decoders["slot"].prefill, prompts, first_slot=0)}
        logits = {name: call() for name, call in calls.items()}  # the slot prefill's kernels compile here (CUDA)
        gap = (logits["slot"].float() - logits["hf"].float()).abs().max().item()
        pairs = list(zip(decoders["hf"].keys + decoders["hf"].values,
                         decoders["slot"].keys + decoders["slot"].values, strict=True))
        cache_gap = max((new.float() - ref.float()).abs().max().item() for ref, new in pairs)
        # each layer's keys (values) as |slot - hf| / |hf| over the tensor: in bf16 the two prefills round
        # differently (other GEMM splits) from the first layer on and the gap grows with depth, so the first
        # layer's gap is one rounding and the worst layer's is what the depth made of it; a misplaced or stale
        # row would move them by ~1. fp32 is compared element-wise (`tolerance`).
        relative = [((new.float() - ref.float()).norm() / ref.float().norm()).item() for ref, new in pairs]
        layers = len(relative) // 2
        first_layer = max(relative[0], relative[layers])
        match = all(torch.allclose(new, ref, rtol=tolerance, atol=tolerance) for ref, new in pairs)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(call_ms(call, args.prefill_steps, warmup=2))
        hf, slot = (statistics.median(times[n]) for n in calls)
        print(f"prefill {batch:4d} x {args.prompt_len} tokens: transformers + write_prefill {hf:.2f} ms, slot prefill "
              f"{slot:.2f} ms ({(hf - slot) / hf:+.1%}); max |logit gap| {gap:.3g}, max |key/value gap| "
              f"{cache_gap:.3g}, relative gap first layer {first_layer:.2g} / worst {max(relative):.2g}"
              + (f", caches match (tolerance {tolerance:g}): {match}" if exact else " (bf16)"), flush=True)
        if args.profile:
            print_profile(calls["slot"], args.profile, title=f"slot prefill, {batch} x {args.prompt_len} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-qwen2", default="0.5b", choices=[*sorted(QWEN2_SHAPES), "micro"],
                        help="micro: 1 layer, hidden 64 (bench/engine.py's), for a CPU smoke run of --prefill")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-len", type=int, default=1024, help="slot length (graphs for every length bucket)")
    parser.add_argument("--sampler", action="store_true",
                        help="also time the sampler on each batch's logits, eager and compiled (the RL case)")
    parser.add_argument("--prefill", action="store_true",
                        help="time the prompt prefill instead: transformers + write_prefill vs the slot prefill")
    parser.add_argument("--prompt-len", type=int, default=128, help="--prefill: tokens per prompt")
    parser.add_argument("--prefill-steps", type=int, default=20, help="--prefill: timed calls per round")
    parser.add_argument("--device", default="cuda", help="cpu: only for a smoke run of --prefill")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--disable-fused-kv-write", action="store_true",
                        help="decode: every decoder with the rotary + K/V cache writes unfused (no A/B of it)")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after timing, one replay of the fused graph per batch under torch.profiler "
                             "(--prefill: one slot prefill)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type != "cuda" and not args.prefill:
        parser.error("the decode graphs need CUDA (--device cpu runs --prefill only)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_qwen2 == "micro":
            from engine import save_micro_qwen2

            path = save_micro_qwen2(Path(tmp) / "model", dtype)
        else:
            path = save_random_qwen2(Path(tmp) / "model", args.random_qwen2, dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    fusion = ProjectionFusion(model)
    if args.prefill:
        with torch.inference_mode():
            compare_prefill(model, fusion, args, device)
        return
    slots = max(args.batches)
    decoders = {}
    with torch.inference_mode():
        kv_write = not args.disable_fused_kv_write
        variants = [("unfused", None, kv_write), ("fused", fusion, kv_write)]
        if kv_write:
            variants.append(("no fused kv write", fusion, False))
        for name, projections, fuse_kv_write in variants:
            decoder = SlotDecoder(model, slots=slots, max_len=args.max_len, device=torch.device("cuda"),
                                  cuda_graphs=True, projections=projections, fuse_kv_write=fuse_kv_write)
            generator = torch.Generator(device="cuda").manual_seed(0)
            for cache in decoder.keys + decoder.values:
                cache.normal_(generator=generator)
            decoders[name] = decoder
        tokens = torch.randint(0, model.config.vocab_size, (slots,), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(1))
        for batch in args.batches:
            logits = {name: d.decode(tokens[:batch], [200] * batch) for name, d in decoders.items()}  # captures
            gap = (logits["fused"] - logits["unfused"]).abs().max().item()
            bucket = next(b for b in decoders["fused"].batch_buckets if b >= batch)
            graphs = {name: d._graphs[(bucket, 256)][0] for name, d in decoders.items()}
            times: dict[str, list[float]] = {name: [] for name in graphs}
            for _ in range(args.rounds):
                for name, graph in graphs.items():
                    times[name].append(call_ms(graph.replay, args.steps))
            unfused, fused = (statistics.median(times[n]) for n in ("unfused", "fused"))
            line = (f"batch {batch:4d} (bucket {bucket}): unfused {unfused:.3f} ms, fused {fused:.3f} ms per replayed "
                    f"step ({(unfused - fused) / unfused:+.1%}); max |logit gap| {gap:.3g}")
            if "no fused kv write" in times:
                plain = statistics.median(times["no fused kv write"])
                kv_gap = (logits["fused"] - logits["no fused kv write"]).abs().max().item()
                line += (f"; fused, K/V write unfused {plain:.3f} ms (fused K/V write {(plain - fused) / plain:+.1%}, "
                         f"max |logit gap| {kv_gap:.3g})")
            print(line, flush=True)
            if args.sampler:
                print(f"batch {batch:4d} {compare_sampler(logits['fused'], args.steps, args.rounds)}", flush=True)
            if args.profile:
                print_profile(graphs["fused"].replay, args.profile, title=f"batch {batch}, one replayed step")


if __name__ == "__main__":
    main()
