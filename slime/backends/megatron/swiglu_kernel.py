"""megatron's SwiGLU activation (`bias_activation_fusion`, no bias) as one hand-written Triton kernel forward and
one backward (CUDA), for the same reason as rope_kernel: megatron's `bias_swiglu_impl` runs `SwiGLUFunction`, whose
forward and backward each call a torch.compile'd function (`jit_fuser`), and a compiled call costs the host far
more than a kernel launch; the 0.5B step at micro-batch 1 is bound by the host (docs/benchmarks.md). Its eager
alternative (`bias_activation_fusion: false`) makes 2 kernels forward and ~6 backward.

Arithmetic, as megatron's `swiglu` / `swiglu_back` (the input y = (y1, y2) halves of the last dimension, saved for
backward as megatron saves it): forward silu(y1) y2 = (y1 sigmoid(y1)) y2; backward, with s = sigmoid(y1),
dy1 = g s (1 + y1 (1 - s)) y2 and dy2 = g (y1 s); all in fp32 from the inputs' dtype, rounded once to it, in the
order megatron writes them (inductor keeps it), so the values are the compiled ones up to the last bit of a
sigmoid (tests/backends/megatron/test_swiglu_kernel_gpu.py).

`install()` puts `bias_swiglu_impl` where megatron's MLP looks it up; it runs the kernel where it applies (CUDA,
Triton, no bias, no FP8 input store, no activation offloading) and megatron's own function otherwise.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from slime.compiled import triton_on_cuda

_ORIGINAL: dict[str, Any] = {}


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward(y_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = col < width
        y1 = tl.load(y_ptr + row * 2 * width + col, mask=live).to(tl.float32)
        y2 = tl.load(y_ptr + row * 2 * width + width + col, mask=live).to(tl.float32)
        out = (y1 * tl.sigmoid(y1)) * y2
        tl.store(out_ptr + row * width + col, out.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def backward(g_ptr, y_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = col < width
        g = tl.load(g_ptr + row * width + col, mask=live).to(tl.float32)
        y1 = tl.load(y_ptr + row * 2 * width + col, mask=live).to(tl.float32)
        y2 = tl.load(y_ptr + row * 2 * width + width + col, mask=live).to(tl.float32)
        s = tl.sigmoid(y1)
        dy1 = g * s * (1 + y1 * (1 - s)) * y2
        dy2 = g * (y1 * s)
        tl.store(out_ptr + row * 2 * width + col, dy1.to(out_ptr.dtype.element_ty), mask=live)
        tl.store(out_ptr + row * 2 * width + width + col, dy2.to(out_ptr.dtype.element_ty), mask=live)

    return forward, backward


BLOCK = 1024  # columns of one row per program


def _grid(rows: int, width: int) -> tuple[int, int]:
    return rows, -(-width // BLOCK)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        rows, width = y.shape[0], y.shape[1] // 2
        out = torch.empty((rows, width), dtype=y.dtype, device=y.device)
        if rows and width:
            _kernels()[0][_grid(rows, width)](y, out, width, BLOCK=BLOCK)
        ctx.save_for_backward(y)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        grad = grad.contiguous()
        rows, width = grad.shape
        out = torch.empty_like(y)
        if rows and width:
            _kernels()[1][_grid(rows, width)](grad, y, out, width, BLOCK=BLOCK)
        return out


def applies(y: torch.Tensor, bias: torch.Tensor | None, fp8_input_store: bool, cpu_offload_input: bool) -> bool:
    """Whether the kernel runs this call (see the module docstring)."""
    return (bias is None and not fp8_input_store and not cpu_offload_input and y.is_cuda and y.dim() in (2, 3)
            and y.shape[-1] % 2 == 0 and triton_on_cuda())


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(y1) * y2 of the last dimension's halves, differentiable in `y` (a CUDA tensor where `applies`)."""
    shape = y.shape
    out = _SwiGLU.apply(y.reshape(-1, shape[-1]).contiguous())
    return out.view(*shape[:-1], shape[-1] // 2)


def bias_swiglu_impl(input: torch.Tensor, bias: torch.Tensor | None, fp8_input_store: bool = False,
                     cpu_offload_input: bool = False) -> torch.Tensor:
    """megatron's `bias_swiglu_impl` signature: the kernel where it applies, megatron's function otherwise."""
    if applies(input, bias, fp8_input_store, cpu_offload_input):
        return swiglu(input)
    return _ORIGINAL["impl"](input, bias, fp8_input_store, cpu_offload_input)


def install(enabled: bool = True) -> None:
    """Let megatron's MLP call `bias_swiglu_impl` (idempotent), or megatron's own again (`enabled` False, the
    A/B of bench/train_step.py --ab triton-swiglu)."""
    from megatron.core.transformer import mlp

    if not _ORIGINAL:
        _ORIGINAL["impl"] = mlp.bias_swiglu_impl
    mlp.bias_swiglu_impl = bias_swiglu_impl if enabled else _ORIGINAL["impl"]


def installed() -> bool:
    from megatron.core.transformer import mlp

    return mlp.bias_swiglu_impl is bias_swiglu_impl
