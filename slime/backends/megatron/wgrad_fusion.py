"""megatron's gradient-accumulation fusion (`gradient_accumulation_fusion`) on torch ops instead of Apex.

With the fusion on, megatron's linear layers (`megatron.core.tensor_parallel.layers`) compute a trainable
weight's gradient as `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output, main_grad)`:
Apex's one cuBLAS GEMM with bf16 operands, an fp32 C and beta 1, i.e. `main_grad += grad_output^T @ input`
accumulated and added in fp32; autograd gets a dummy gradient that megatron DDP's hook then skips. Without
Apex the layers write a bf16 weight gradient and DDP adds it to the fp32 `main_grad` in a second kernel
(`main_grad.add_(grad)`): 53 ms of a 1.03 s step at 1.5B (docs/benchmarks.md).

torch has Apex's GEMM: `baddbmm` with `out_dtype=torch.float32` and `out=main_grad` (a batch of one) runs
cuBLAS `gemm<bf16, float>` with `main_grad` itself as C and beta 1 (`_baddbmm_out_dtype_cuda` in
aten/src/ATen/native/cuda/Blas.cpp). `addmm`'s out_dtype variant does not fit: it copies its bf16 `self` into
the fp32 output first, so it cannot add onto an fp32 accumulator. The out_dtype GEMMs have no CPU kernel;
there the provider computes the same sum from fp32 copies of the bf16 operands (bf16 x bf16 products are
exact in fp32), the reference the CUDA path is tested against.

Numerics against today's unfused path: the same fp32 accumulation into `main_grad`, minus one rounding, as
with Apex: today each micro-batch's weight gradient is rounded to bf16 before the fp32 add; fused, the fp32
GEMM result is added directly. fp32 weights (CPU tests) take a plain fp32 `addmm_`.

`install()` puts the provider where megatron's layers look for Apex's module (their module globals
`fused_weight_gradient_mlp_cuda` and `_grad_accum_fusion_available`; never where Apex is installed).
megatron's pipeline-drain embedding path (`defer_embedding_wgrad_compute`) imports the module by name and
is not covered: `check_options` refuses it.
"""

from __future__ import annotations

import functools
import logging
import types

import torch

from slime.errors import ConfigError

logger = logging.getLogger(__name__)


def wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Apex's contract: `main_grad` (fp32, [out, in]) += grad_output^T @ input, for 2-D `input` [tokens, in]
    and `grad_output` [tokens, out] of one dtype, summed and added in fp32."""
    if input.dtype == torch.float32:
        main_grad.addmm_(grad_output.t(), input)
    elif main_grad.is_cuda:
        torch.baddbmm(main_grad.unsqueeze(0), grad_output.t().unsqueeze(0), input.unsqueeze(0),
                      out_dtype=torch.float32, out=main_grad.unsqueeze(0))
    else:  # no out_dtype GEMM on the CPU: the reference, from exact fp32 copies of the operands
        main_grad.addmm_(grad_output.t().float(), input.float())


def wgrad_gemm_accum_fp16(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Apex's contract for a 16-bit `main_grad` of the operands' dtype (DDP without grad_reduce_in_fp32)."""
    main_grad.addmm_(grad_output.t(), input)


PROVIDER = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32,
                                 wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)


def install() -> bool:
    """Let megatron's linear layers use `PROVIDER` for `gradient_accumulation_fusion` (idempotent); False where
    Apex's extension is installed and used instead."""
    from megatron.core.tensor_parallel import layers

    current = getattr(layers, "fused_weight_gradient_mlp_cuda", None)
    if layers._grad_accum_fusion_available and current is not PROVIDER:
        return False
    layers.fused_weight_gradient_mlp_cuda = PROVIDER
    layers._grad_accum_fusion_available = True
    return True


@functools.cache
def available() -> bool:
    """Whether the fusion is on by default: CUDA, and this torch's bf16 GEMM with an fp32 out accumulates into
    it as Apex's does (checked once on small matrices against the fp32 reference; older torch lacks out_dtype)."""
    if not torch.cuda.is_available():
        return False
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(96, 40, device="cuda", generator=generator).bfloat16()
    dy = torch.randn(96, 24, device="cuda", generator=generator).bfloat16()
    acc = torch.randn(24, 40, device="cuda", generator=generator)
    expected = (acc.double() + dy.t().double() @ x.double()).float()  # exact: no TF32, no global flag to flip
    try:
        wgrad_gemm_accum_fp32(x, dy, acc)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        logger.warning("gradient_accumulation_fusion stays off: torch's bf16 GEMM with an fp32 output failed (%s)",
                       exc)
        return False
    if not torch.allclose(acc, expected, rtol=1e-5, atol=1e-5):
        logger.warning("gradient_accumulation_fusion stays off: torch's bf16 GEMM into fp32 does not accumulate "
                       "(max error %.3g)", (acc - expected).abs().max().item())
        return False
    return True


def check_options(options: dict) -> None:
    """Refuse what the provider does not cover (named after the megatron options)."""
    if options.get("gradient_accumulation_fusion") and options.get("defer_embedding_wgrad_compute"):
        raise ConfigError("megatron.defer_embedding_wgrad_compute with gradient_accumulation_fusion needs Apex's "
                          "fused_weight_gradient_mlp_cuda module, which torch's provider does not replace "
                          "(slime/backends/megatron/wgrad_fusion.py)")
