"""Frozen-weight linear layers as one GEMM whatever the layout of their input and output gradient.

megatron-core runs a linear layer whose weight does not require grad (every base weight under LoRA, the output
layer included; what a freeze list freezes) through `linear_with_frozen_weight`, which computes
`torch.matmul(input, weight.t())` forward and `grad_output.matmul(weight)` backward on 3-D `[s, b, h]` tensors.
torch's matmul folds a 3-D operand into one 2-D GEMM only when the view costs no copy, or when the 2-D operand
requires grad (`should_fold` in aten/src/ATen/native/LinearAlgebra.cpp); a frozen weight does not, so a
non-contiguous 3-D operand becomes a `bmm` over the `s` positions, each an `[b, h]` GEMM against the whole
weight broadcast along the batch: `s` small GEMMs that each read the weight.

The output layer's gradient is such a tensor from micro-batch 2 on: GPTModel returns `logits.transpose(0, 1)
.contiguous()` (`[b, s, V]`), the loss writes that gradient contiguous, and the transpose's backward hands the
output layer `[s, b, V]` with strides `(V, s V, 1)`. At micro-batch 1 the loss's gradient carries the logits' own
strides (`zeros_like`), which fold. So LoRA at micro-batch 2 ran the output layer's input gradient as 4096 `[2, 151936] x [151936, 1536]`
GEMMs per micro-batch (1.5B, sequence 4096): 2.5x the step time of micro-batch 1 (docs/lora.md), where full
fine-tuning, whose output weight requires grad, folds (one copy of the gradient and one GEMM).

A size-1 batch does not save every layout: the fold test compares raw strides, so `[s, 1, V]` with strides
`(V, s V, 1)`, contiguous by `is_contiguous`, is not folded either.

`install()` puts a wrapper where megatron's layers look the function up (their module global): it hands
megatron a foldable input and makes the gradient reaching megatron's backward foldable (a tensor hook on its
output, so the output itself stays megatron's fresh tensor: LoRA's fused add writes into it in place). A tensor
matmul already folds is passed as it is, tested on its strides without dispatching an op (the step at micro-batch 1
is host-bound: no op is added there); otherwise a re-strided view where one does it, else one copy, what matmul's
fold costs a trainable weight.
"""

from __future__ import annotations

from typing import Any

import torch

_MEGATRON: Any = None  # megatron's own linear_with_frozen_weight, wrapped by `linear_with_frozen_weight`


def folds(tensor: torch.Tensor) -> bool:
    """Whether matmul folds `tensor` (3-D or more) into a 2-D GEMM operand without a copy: its leading dimensions
    are one run of memory (the stride test of torch's `should_fold`, read here without dispatching an op)."""
    shape, strides = tensor.shape, tensor.stride()
    return all(strides[i] == strides[i + 1] * shape[i + 1] for i in range(tensor.dim() - 2))


def foldable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself where matmul folds it, else re-strided so it does: a view where one does it (a size-1
    dimension's stride, which `is_contiguous` ignores and the fold test does not), else a contiguous copy."""
    if tensor.dim() < 3 or not tensor.numel() or folds(tensor):
        return tensor
    return tensor.reshape(-1, tensor.shape[-1]).view(tensor.shape)


def linear_with_frozen_weight(input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """megatron's `linear_with_frozen_weight` on a foldable input, its output gradient made foldable."""
    output = _MEGATRON(foldable(input), weight, *args, **kwargs)
    if output.requires_grad:
        output.register_hook(foldable)
    return output


def install() -> None:
    """Let megatron's Column/RowParallelLinear use `linear_with_frozen_weight` for frozen weights (idempotent)."""
    global _MEGATRON
    from megatron.core.tensor_parallel import layers

    if layers.linear_with_frozen_weight is not linear_with_frozen_weight:
        _MEGATRON = layers.linear_with_frozen_weight
        layers.linear_with_frozen_weight = linear_with_frozen_weight
