"""The rotary embedding of a query or key as one hand-written Triton kernel forward and one backward (CUDA).

rope_fusion's compiled rotation (torch.compile of `rope_fusion.rotate`) already makes one kernel each way, but a
call into a torch.compile'd function costs the host far more than launching it: dynamo's frame hook, AOTAutograd's
runtime wrappers and inductor's generated `call`, ~0.27 ms forward and ~0.14 ms backward per call measured under
cProfile on an H100 host, 384 calls a step at 0.5B (24 layers, query and key, 8 micro-batches): where the step is
bound by the host issuing kernels (0.5B at micro-batch 1, docs/benchmarks.md) that is a tenth of the step. Eager
kernels cost less host time but ~5 elementwise passes each way. Nothing in torch or megatron-core provides a fused
rotary kernel without Transformer Engine, so this is one: an autograd Function whose forward and backward each
launch this kernel once.

Arithmetic (non-interleaved halves, the Qwen/Llama layout): with x = (x1, x2) and cos/sin = (c1, c2)/(s1, s2),
forward y = (x1 c1 - x2 s1, x2 c2 + x1 s2); backward, the transposed rotation of the output gradient g,
dx = (g1 c1 + g2 s2, g2 c2 - g1 s1). Operands are read in their dtype and computed in fp32 (each product of two
bf16 values is exact there), the sum rounded once to the output dtype: the same values as the compiled rotation
(tests/backends/megatron/test_rope_kernel_gpu.py checks both against each other and against the fp64 rotation).

`applies` says where it runs: CUDA tensors, Triton importable, the halves layout, the whole head dimension rotated,
a head dimension of 2 x a power of two >= 16, and one cos/sin row per position (megatron's [seq, 1, 1, dim]).
Elsewhere `rope_fusion` uses the compiled rotation. The input may be a strided view (megatron's query and key are
views of the fused QKV projection's output); the output is contiguous.
"""

from __future__ import annotations

import functools

import torch

from slime.compiled import triton_on_cuda


def applies(t: torch.Tensor, cos: torch.Tensor, interleaved: bool) -> bool:
    """Whether `rotary` handles this call (see the module docstring); rope_fusion falls back otherwise."""
    dim = t.shape[-1]
    half = dim // 2
    return (t.is_cuda and not interleaved and t.dim() == 4 and cos.dim() == 4 and cos.shape[-1] == dim
            and half >= 16 and half & (half - 1) == 0 and cos.shape[0] == t.shape[0]
            and cos.shape[1] == 1 and cos.shape[2] == 1 and triton_on_cuda())


@functools.cache
def _kernel():
    """The Triton kernel, defined on first use (Triton is imported only where the kernel runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rotate_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, rows, batch, heads, stride_s, stride_b, stride_h, stride_d,
                    cos_stride_s, HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, BACKWARD: tl.constexpr):
        # one program: BLOCK_ROWS (position, sample, head) rows of one head vector each, both halves
        row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        col = tl.arange(0, HALF)[None, :]
        live = (row < rows)[:, None] & (col < HALF)  # [BLOCK_ROWS, HALF]
        head = row % heads
        rest = row // heads
        sample = rest % batch
        position = (rest // batch).to(tl.int64)
        src = (position * stride_s + sample.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h)[:, None]
        x1 = tl.load(x_ptr + src + col * stride_d, mask=live).to(tl.float32)
        x2 = tl.load(x_ptr + src + (col + HALF) * stride_d, mask=live).to(tl.float32)
        angle = (position * cos_stride_s)[:, None]
        c1 = tl.load(cos_ptr + angle + col, mask=live).to(tl.float32)
        c2 = tl.load(cos_ptr + angle + col + HALF, mask=live).to(tl.float32)
        s1 = tl.load(sin_ptr + angle + col, mask=live).to(tl.float32)
        s2 = tl.load(sin_ptr + angle + col + HALF, mask=live).to(tl.float32)
        if BACKWARD:  # the transposed rotation
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        dst = row.to(tl.int64)[:, None] * (2 * HALF) + col
        tl.store(out_ptr + dst, y1.to(out_ptr.dtype.element_ty), mask=live)
        tl.store(out_ptr + dst + HALF, y2.to(out_ptr.dtype.element_ty), mask=live)

    return rotate_rows


BLOCK_ROWS = 16  # 16 head vectors of 128 (bf16: 4 KiB in, 4 KiB out) per program


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    seq, batch, heads, dim = x.shape
    out = torch.empty((seq, batch, heads, dim), dtype=x.dtype, device=x.device)
    rows = seq * batch * heads
    if rows:
        _kernel()[(-(-rows // BLOCK_ROWS),)](
            x, cos, sin, out, rows, batch, heads, *x.stride(), cos.stride(0),
            HALF=dim // 2, BLOCK_ROWS=BLOCK_ROWS, BACKWARD=backward)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _launch(t, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _launch(grad, cos, sin, backward=True), None, None


def rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`t` [seq, batch, heads, dim] rotated by `cos`/`sin` [seq, 1, 1, dim] (in `t`'s dtype), differentiable in `t`;
    only where `applies(t, cos, False)`."""
    return _Rotary.apply(t, cos.contiguous(), sin.contiguous())  # the kernel indexes both as [seq, dim] rows
