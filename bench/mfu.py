"""What bench/train_step.py and bench/torch_reference.py share: the MFU accounting (one formula, two scripts)
and the arguments that name the measured step, so both measure the same thing from the same command line.

A trained token costs 6 x params FLOPs (forward 2N, backward 4N; params counts a tied embedding once:
it is the output layer's matmul), plus the causal attention matmuls, 6 x layers x seq x hidden (half of
the full 12 L s h, since a causal mask halves the work). A forward-only pass (the log-prob recompute of
an RL step) costs a third of each: 2N and 2 L s h. Activation recompute is not counted (the usual MFU,
not HFU). Peak is H100 dense bf16, 989 TFLOP/s, unless the caller says otherwise.
"""

from __future__ import annotations

import argparse

from slime.data.random_models import QWEN2_SHAPES

H100_BF16_TFLOPS = 989.0


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shape, batch and timing arguments of a train-step benchmark."""
    parser.add_argument("--model", choices=sorted(QWEN2_SHAPES), default="0.5b")
    parser.add_argument("--seq", type=int, nargs="+", default=[1024])
    parser.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS, help="H100 dense bf16")


def flops_per_token(params: int, layers: int, hidden: int, seq: int,
                    forward_passes: int = 0) -> tuple[float, float]:
    """(dense, attention) FLOPs per token of one train pass plus `forward_passes` forward-only passes."""
    factor = 6 + 2 * forward_passes
    return factor * params, factor * layers * seq * hidden


def mfu_fields(params: int, layers: int, hidden: int, seq: int, tokens_per_s: float, *,
               peak_tflops: float = H100_BF16_TFLOPS, forward_passes: int = 0) -> dict[str, float]:
    """`mfu` (dense FLOPs only) and `mfu_with_attention`, as fractions of the peak."""
    dense, attention = flops_per_token(params, layers, hidden, seq, forward_passes)
    peak = peak_tflops * 1e12
    return {"mfu": round(dense * tokens_per_s / peak, 4),
            "mfu_with_attention": round((dense + attention) * tokens_per_s / peak, 4)}
