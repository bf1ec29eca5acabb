"""Host and GPU time of one rotary call (forward + backward) per kernel: rope_kernel's Triton rotation, the
torch.compile'd `rope_fusion.rotate`, and the same rotation as eager kernels, at the query/key shapes of Qwen2
0.5B (14 and 2 heads of 64) and 1.5B (12 and 2 heads of 128), 4096 positions, bf16.

    python bench/rope.py
    python bench/rope.py --calls 500 --seq 4096

`host_us`: the time the host takes to issue one call (forward and backward; `--calls` calls back to back, no
synchronisation, divided by the count: the GPU finishes them later, and with kernels this short the host is the
bound); `gpu_us`: the GPU time of one call measured with CUDA events over the same loop after a synchronisation,
bounded below by the issue time where the host is slower. Why it matters: the 0.5B train step at micro-batch 1 is
bound by the host issuing kernels, and megatron calls the rotation twice a layer (docs/megatron.md). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

SHAPES = {"0.5b query": (14, 64), "0.5b key": (2, 64), "1.5b query": (12, 128), "1.5b key": (2, 128)}


def kernels(cos: torch.Tensor, sin: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from slime.backends.megatron import rope_fusion, rope_kernel

    return {"triton": lambda t: rope_kernel.rotary(t, cos, sin),
            "compiled": lambda t: rope_fusion._compiled(t, cos, sin, False),
            "eager": lambda t: rope_fusion.rotate(t, cos, sin)}


def time_calls(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor, grad: torch.Tensor,
               calls: int) -> dict[str, float]:
    for _ in range(5):  # compile, autotune, warm caches
        fn(t).backward(grad)
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_event.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn(t).backward(grad)
    host = time.perf_counter() - start
    end_event.record()
    torch.cuda.synchronize()
    return {"host_us": round(host / calls * 1e6, 1),
            "gpu_us": round(start_event.elapsed_time(end_event) / calls * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/rope.py needs CUDA")
    from slime.backends.megatron import rope_fusion

    generator = torch.Generator(device="cuda").manual_seed(0)
    for name, (heads, dim) in SHAPES.items():
        t = torch.randn(args.seq, 1, heads, dim, device="cuda", generator=generator).bfloat16().requires_grad_()
        grad = torch.randn(t.shape, device="cuda", generator=generator).bfloat16()
        freqs = torch.randn(args.seq, 1, 1, dim, device="cuda", generator=generator)
        cos, sin = rope_fusion.cos_sin(freqs, t.dtype)
        row = {"shape": name, "seq": args.seq, "heads": heads, "head_dim": dim}
        for kernel, fn in kernels(cos, sin).items():
            row[kernel] = time_calls(fn, t, grad, args.calls)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
