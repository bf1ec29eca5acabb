"""megatron's frozen-weight linear (every base weight under LoRA) as one GEMM whatever its tensors' layout
(slime/backends/megatron/frozen_linear.py): the output layer's gradient at micro-batch >= 2 is a transposed
`[s, b, V]` view, which megatron's `grad_output.matmul(weight)` ran as a `bmm` of one `[b, V]` GEMM per position."""

import collections

import pytest
import torch
from megatron.core.tensor_parallel import layers
from torch.profiler import profile

from slime.backends.megatron import frozen_linear

S, H, V = 24, 16, 40


def _ops(fn) -> collections.Counter:
    """(op name, input shapes) -> count of the matmul-family ops `fn()` runs."""
    with profile(record_shapes=True) as prof:
        fn()
    return collections.Counter({(e.key, str(e.input_shapes)): e.count for e in prof.key_averages(group_by_input_shape=True)
                                if e.key in ("aten::bmm", "aten::mm", "aten::addmm")})


def _output_layer(batch: int, seed: int = 0):
    """hidden [s, b, h] (requires grad, as after trainable adapters), the frozen output weight [V, h], and the
    gradient the loss writes for GPTModel's `[b, s, V]` logits."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, batch, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    grad = torch.randn(batch, S, V, generator=g, dtype=torch.float64)
    return hidden, weight, grad


def _logits_backward(hidden, weight, grad) -> None:
    """What GPTModel does with the output layer (`logits.transpose(0, 1).contiguous()`), then the loss's backward."""
    out = layers.linear_with_frozen_weight(hidden, weight, None, False, False, False, None)
    out.transpose(0, 1).contiguous().backward(grad)


@pytest.fixture(autouse=True)
def installed():
    frozen_linear.install()
    frozen_linear.install()  # idempotent: still wraps megatron's own function, not itself
    assert layers.linear_with_frozen_weight is frozen_linear.linear_with_frozen_weight
    assert frozen_linear._MEGATRON is not frozen_linear.linear_with_frozen_weight


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_the_output_layer_gradient_is_one_gemm_at_every_micro_batch(batch):
    hidden, weight, grad = _output_layer(batch)
    ops = _ops(lambda: _logits_backward(hidden, weight, grad))
    assert not [op for op in ops if op[0] == "aten::bmm"], ops  # was: bmm [[S, b, V], [S, V, H]] from b = 2 on
    assert ops[("aten::mm", str([[S * batch, V], [V, H]]))] == 1, ops  # the input gradient, one GEMM
    expected = torch.einsum("bsv,vh->sbh", grad, weight)
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-12, atol=1e-12)


def test_a_non_contiguous_input_is_one_gemm_forward():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, S, H, generator=g, dtype=torch.float64).transpose(0, 1)  # [s, b, h], batch-major memory
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    assert not x.is_contiguous()
    out = None

    def forward() -> None:
        nonlocal out
        out = layers.linear_with_frozen_weight(x, weight, None, False, False, False, None)

    ops = _ops(forward)
    assert not [op for op in ops if op[0] == "aten::bmm"], ops
    torch.testing.assert_close(out, torch.einsum("sbh,vh->sbv", x, weight), rtol=1e-12, atol=1e-12)


def test_without_grad_no_hook_and_the_same_values():
    hidden, weight, _ = _output_layer(2, seed=2)
    with torch.no_grad():
        out = layers.linear_with_frozen_weight(hidden, weight, None, False, False, False, None)
    assert not out.requires_grad
    torch.testing.assert_close(out, hidden.detach() @ weight.t(), rtol=1e-12, atol=1e-12)


def test_lora_adds_in_place_onto_the_hooked_output_with_the_same_gradients():
    """LoRA's fused add writes into the frozen layer's output (`mark_dirty`) after the hook is registered on it:
    values and gradients stay the textbook `x W^T + scale (x A^T) B^T`, and the output is still written in place."""
    from slime.backends.megatron.lora import _AddScaledLinear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, S, H, generator=g, dtype=torch.float64).transpose(0, 1).requires_grad_()  # not foldable
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    a = torch.randn(4, H, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(V, 4, generator=g, dtype=torch.float64).requires_grad_()
    grad = torch.randn(2, S, V, generator=g, dtype=torch.float64).transpose(0, 1)  # [s, b, V], not foldable
    base = layers.linear_with_frozen_weight(x, weight, None, False, False, False, None)
    y = _AddScaledLinear.apply(base, torch.nn.functional.linear(x, a), b, 2.0)
    assert y is base  # in place: the hook left megatron's output a fresh tensor, not a view
    got = torch.autograd.grad(y, (x, a, b), grad)
    ref_y = x @ weight.t() + 2.0 * (x @ a.t()) @ b.t()
    want = torch.autograd.grad(ref_y, (x, a, b), grad)
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    for name, new, old in zip(("x", "A", "B"), got, want, strict=True):
        torch.testing.assert_close(new, old, rtol=1e-12, atol=1e-12, msg=name)


def test_foldable_is_free_where_matmul_already_folds():
    """The common case (micro-batch 1, contiguous activations) costs no op at all: the tensor itself comes back;
    a size-1 batch with an odd stride is re-strided as a view (no copy); only a real transpose is copied."""
    x = torch.randn(S, 2, H)
    assert frozen_linear.foldable(x) is x and frozen_linear.folds(x)
    odd = torch.randn(1, S, V).transpose(0, 1)  # [s, 1, V], strides (V, s V, 1): contiguous, yet not folded
    assert odd.is_contiguous() and not frozen_linear.folds(odd)
    view = frozen_linear.foldable(odd)
    assert frozen_linear.folds(view) and view.data_ptr() == odd.data_ptr() and torch.equal(view, odd)
    transposed = torch.randn(2, S, V).transpose(0, 1)
    copy = frozen_linear.foldable(transposed)
    assert frozen_linear.folds(copy) and copy.data_ptr() != transposed.data_ptr() and torch.equal(copy, transposed)
