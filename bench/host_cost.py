"""Host (Python) cost of one train step, measured on the CPU with a model whose kernels cost next to nothing.

    OMP_NUM_THREADS=1 python bench/host_cost.py                        # megatron and HF train steps, log-prob pass
    OMP_NUM_THREADS=1 python bench/host_cost.py --which megatron --profile 25
    OMP_NUM_THREADS=1 python bench/host_cost.py --which megatron --no-host-trims   # an A/B flag of bench/train_step.py
    OMP_NUM_THREADS=1 python bench/host_cost.py --ab host-trims --lora-rank 8   # that change on/off, step by step

On an H100 the 0.5B step is bound by the host issuing kernels, not by the kernels. Here the 0.5B layer structure
(Qwen2: GQA attention with q/k/v bias, SwiGLU MLP, RMSNorm, rotary, tied embedding) gets tiny dimensions (hidden
64, 4 heads / 2 KV heads, FFN 128, vocab 512, seq 16) so that each aten kernel on the CPU costs microseconds and
the time a step takes is what the host pays: Python in megatron-core's modules, in slime's wrappers and hooks, and
the dispatcher. Each model is built at `--layers` (default 2 and 6) and stepped `--warmup` + `--steps` times, as
bench/train_step.py (`slime.backends.megatron.train.train_step`, SFT loss, megatron DDP and its optimizer) and
bench/torch_reference.py (HF Qwen2, SDPA, AdamW) drive them; `logprobs` is `compute_log_probs` (forward only).

How to read the table (microseconds of the main thread's CPU time, `--clock wall` for wall time; median step):

* `step` - the whole step's time, at each layer count;
* `layer fwd+bwd (diff)` - (step at the most layers - step at the fewest) / (layer difference x micro-batches):
  what one more layer costs per micro-batch, no instrumentation involved;
* `layer fwd`, `layer bwd` - the split of that, timed by hooks (forward pre/post hooks on each layer; gradient
  hooks on each layer's output for backward), the mean per layer and micro-batch; hooks add a little of their own;
* `micro-batch fixed` - (step - optimizer - layers x micro-batches x layer fwd+bwd) / micro-batches: what a
  micro-batch pays outside the layers (batching, embedding, head, loss, schedule, DDP hooks);
* `step fixed (optimizer)` - the optimizer step (megatron: grad finalize excluded; its step, clip, copy back).

`--profile N` runs one more step of each model at the most layers under cProfile and prints its N top functions
by cumulative time. Fewer threads = steadier numbers: run with OMP_NUM_THREADS=1 (the script also sets torch's threads to 1).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from profiling import interleaved_ab  # noqa: E402


def clock() -> float:
    """Seconds of this thread's CPU time (`--clock cpu`, the default: what the host spends, unaffected by other
    processes on a busy machine; the CPU autograd engine runs backward on the calling thread) or wall time."""
    return _CLOCK()


_CLOCK = time.thread_time
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=512,
            tie_word_embeddings=True)


class LayerTimer:
    """Per-layer forward and backward time (`clock`) by hooks: forward from a layer's pre-hook to its post-hook; backward
    from the gradient reaching a layer's output to the gradient reaching the previous layer's output (or the first
    layer's input)."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.fwd = 0.0
        self.bwd = 0.0
        self.calls = 0
        self._start = 0.0
        self._bwd_mark: float | None = None
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._pre(i), with_kwargs=True)
            layer.register_forward_hook(self._post)

    def _pre(self, index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if index == 0 and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(self._grad_end)
            self._start = clock()
        return hook

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.fwd += clock() - self._start
        self.calls += 1
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._grad_mark)

    def _grad_mark(self, grad: torch.Tensor) -> None:
        now = clock()
        if self._bwd_mark is not None:
            self.bwd += now - self._bwd_mark
        self._bwd_mark = now

    def _grad_end(self, grad: torch.Tensor) -> None:
        self._grad_mark(grad)
        self._bwd_mark = None

    def reset(self) -> None:
        self.fwd = self.bwd = 0.0
        self.calls = 0
        self._bwd_mark = None


def timed_optimizer(optimizer: Any) -> list[float]:
    """Wrap `optimizer.step` to record its time (`clock`, seconds) per call."""
    times: list[float] = []
    step = optimizer.step

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return step(*args, **kwargs)
        finally:
            times.append(clock() - start)
    optimizer.step = wrapped
    return times


def megatron_runner(config: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The Megatron model and a train step / log-prob pass over `args.micro_batches` samples, as bench/train_step.py."""
    from mbridge.core.util import unwrap_model
    from train_step import build_megatron, megatron_options

    from slime.backends.megatron.logprobs import compute_log_probs
    from slime.backends.megatron.train import StepSettings, train_step
    from slime.types import Sample

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    _, models, _, optimizer = build_megatron(config, dtype, megatron_options(args.megatron), lora_rank=args.lora_rank,
                                             fused_adam=True, rope_cos_sin_cache=args.rope_cos_sin_cache,
                                             trims=args.host_trims, foreach_param_copy=args.foreach_param_copy)
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=1)
    generator = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, config.vocab_size, (args.seq,), generator=generator).tolist(),
                      response_length=args.seq - 1) for i in range(args.micro_batches)]
    gpt = unwrap_model(models)[0]
    return {"layers": list(gpt.decoder.layers), "optimizer": optimizer,
            "step": lambda: train_step(models, optimizer, samples, settings, vocab_size=config.vocab_size),
            "logprobs": lambda: compute_log_probs(models, samples, vocab_size=config.vocab_size, micro_batch_size=1)}


def hf_runner(config: Any, args: argparse.Namespace) -> dict[str, Any]:
    """HF Qwen2 stepped as bench/torch_reference.py steps it (AdamW fused, as on CUDA; no checkpointing)."""
    from torch_reference import build, train_step

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, optimizer = build(config, torch.device("cpu"), grad_checkpointing=False, dtype=dtype, fused=True)
    tokens = torch.randint(0, config.vocab_size, (args.micro_batches, args.seq),
                           generator=torch.Generator().manual_seed(0))
    return {"layers": list(model.model.layers), "optimizer": optimizer,
            "step": lambda: train_step(model, optimizer, tokens, 1)}


def measure(run: dict[str, Any], kind: str, args: argparse.Namespace) -> dict[str, float]:
    """Median time (us, `clock`) of `run[kind]` and, with the layer hooks, per-layer fwd/bwd and optimizer time."""
    timer = LayerTimer(run["layers"])
    opt_times = timed_optimizer(run["optimizer"])
    rows: list[tuple[float, float, float, float]] = []
    for i in range(args.warmup + args.steps):
        timer.reset()
        opt_times.clear()
        grad = torch.no_grad() if kind == "logprobs" else torch.enable_grad()
        with grad:
            start = clock()
            run[kind]()
            total = clock() - start
        if i >= args.warmup:
            calls = max(timer.calls, 1)
            rows.append((total, timer.fwd / calls, timer.bwd / calls, sum(opt_times)))
    med = [statistics.median(col) * 1e6 for col in zip(*rows, strict=True)]
    return dict(zip(("step", "fwd", "bwd", "opt"), med, strict=True))


def profile(run: dict[str, Any], kind: str, top: int) -> str:
    """One more `run[kind]` under cProfile: its `top` functions by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    run[kind]()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def summarize(by_layers: dict[int, dict[str, float]], micro_batches: int) -> dict[str, float]:
    """The table's derived rows from the measurements at each layer count (see the module docstring)."""
    lo, hi = min(by_layers), max(by_layers)
    diff = (by_layers[hi]["step"] - by_layers[lo]["step"]) / ((hi - lo) * micro_batches)
    m = by_layers[hi]
    fixed = (m["step"] - m["opt"] - hi * micro_batches * (m["fwd"] + m["bwd"])) / micro_batches
    return {**{f"step ({n} layers)": v["step"] for n, v in sorted(by_layers.items())},
            "layer fwd+bwd (diff)": diff, "layer fwd": m["fwd"], "layer bwd": m["bwd"],
            "micro-batch fixed": fixed, "step fixed (optimizer)": m["opt"]}


def main() -> None:
    from transformers import Qwen2Config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--which", choices=("all", "megatron", "hf", "logprobs"), default="all")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 6])
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=8, help="samples per step, one per micro-batch")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--megatron", action="append", default=[], metavar="KEY=VALUE",
                        help="a megatron model option, as bench/train_step.py takes it; repeatable")
    parser.add_argument("--rope-cos-sin-cache", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--foreach-param-copy", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="megatron: LoRA adapters of this rank on every linear layer, the base frozen "
                             "(as bench/train_step.py --lora-rank)")
    parser.add_argument("--host-trims", action=argparse.BooleanOptionalAction, default=True,
                        help="slime/backends/megatron/host_trims.py on (the default) or off, as in bench/train_step.py")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this thread's CPU time (steady on a shared machine); wall: wall time")
    parser.add_argument("--ab", choices=("host-trims",), default=None,
                        help="instead of the table: megatron's step and log-prob pass at the most layers with this "
                             "change on and off, alternating step by step (host_trims.install)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N functions")
    args = parser.parse_args()
    if len(set(args.layers)) < 2:
        raise SystemExit("--layers needs two different layer counts (per-layer cost is their difference)")
    torch.set_num_threads(1)
    global _CLOCK
    _CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.ab:
        from slime.backends.megatron import host_trims

        config = Qwen2Config(max_position_embeddings=max(4096, args.seq), num_hidden_layers=max(args.layers), **TINY)
        run = megatron_runner(config, args)
        for kind in ("step", "logprobs"):
            for _ in range(args.warmup):
                run[kind]()
            result = {arm: t * 1e6 for arm, t in interleaved_ab(run[kind], host_trims.install, args.steps,
                                                                 clock=clock).items()}
            print(f"{args.ab} {kind} at {max(args.layers)} layers, us ({args.clock}, median of {args.steps} each): "
                  f"on {result['on']:.0f}, off {result['off']:.0f}, saved {result['off'] - result['on']:.0f} "
                  f"({(result['off'] - result['on']) / result['off']:.1%})")
        return
    kinds = {"megatron": (megatron_runner, "step"), "hf": (hf_runner, "step"), "logprobs": (megatron_runner, "logprobs")}
    chosen = list(kinds) if args.which == "all" else [args.which]
    table: dict[str, dict[str, float]] = {}
    for name in chosen:
        build, kind = kinds[name]
        by_layers, run = {}, None
        for layers in sorted(args.layers):
            config = Qwen2Config(max_position_embeddings=max(4096, args.seq), num_hidden_layers=layers, **TINY)
            run = build(config, args)
            by_layers[layers] = measure(run, kind, args)
        table[name] = summarize(by_layers, args.micro_batches)
        if args.profile and run is not None:
            print(f"== {name}: cProfile of one {kind} at {max(args.layers)} layers ==")
            print(profile(run, kind, args.profile))
    rows = list(dict.fromkeys(r for t in table.values() for r in t))
    print(f"host cost, us: tiny Qwen2 (hidden 64, 4/2 heads, FFN 128, vocab 512), seq {args.seq}, "
          f"{args.micro_batches} micro-batches of 1, {args.dtype}, {args.clock} time, median of {args.steps} steps")
    print(f"{'':<26}" + "".join(f"{name:>12}" for name in table))
    for row in rows:
        print(f"{row:<26}" + "".join(f"{t.get(row, float('nan')):>12.0f}" for t in table.values()))


if __name__ == "__main__":
    main()
