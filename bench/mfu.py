"""The MFU accounting shared by bench/train_step.py and bench/torch_reference.py (one formula, two scripts).

A trained token costs 6 x params FLOPs (forward 2N, backward 4N; params counts a tied embedding once:
it is the output layer's matmul), plus the causal attention matmuls, 6 x layers x seq x hidden (half of
the full 12 L s h, since a causal mask halves the work). A forward-only pass (the log-prob recompute of
an RL step) costs a third of each: 2N and 2 L s h. Activation recompute is not counted (the usual MFU,
not HFU). Peak is H100 dense bf16, 989 TFLOP/s, unless the caller says otherwise.
"""

from __future__ import annotations

H100_BF16_TFLOPS = 989.0


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
