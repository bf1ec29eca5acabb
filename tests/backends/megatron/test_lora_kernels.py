"""The adapter's fused add (lora._AddScaledLinear): the same values and gradients as the textbook
`output + scale * F.linear(h, B)`, in place on a fresh base output and out of place on a view, exactly the base
while B is zero, and with no separate scaling or adding operator left (the step is launch-bound on a GPU)."""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from slime.backends.megatron.lora import _AddScaledLinear

SCALE = 2.0  # alpha 16 / rank 8


class _AsIs(torch.autograd.Function):
    """Returns its input as-is, as megatron's TP mappings do at TP 1: autograd then hands out a view."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _layer(seed: int, dtype: torch.dtype = torch.float32, b_zero: bool = False):
    """x [s, b, in] (requires grad, as inside the model), frozen W, adapters A and B as lora.py draws them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 3, 32, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(48, 32, generator=g) / 32**0.5).to(dtype)
    a = ((torch.rand(8, 32, generator=g) * 2 - 1) / 32**0.5).to(dtype).requires_grad_()
    b = torch.zeros(48, 8, dtype=dtype) if b_zero else (torch.randn(48, 8, generator=g) * 0.1).to(dtype)
    return x, w, a, b.requires_grad_()


def _run(x, w, a, b, *, fused: bool, view: bool):
    base = F.linear(x, w)
    if view:
        base = _AsIs.apply(base)
    h = F.linear(x, a)
    return _AddScaledLinear.apply(base, h, b, SCALE) if fused else base + SCALE * F.linear(h, b)


@pytest.mark.parametrize("view", [False, True], ids=["in-place", "out-of-place"])
def test_fused_add_equals_the_formula_with_gradients(view):
    x, w, a, b = _layer(0)
    grad = torch.randn(7, 3, 48, generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        y = _run(x, w, a, b, fused=fused, view=view)
        results.append((y.detach(), *torch.autograd.grad(y, (x, a, b), grad)))
    for name, old, new in zip(("output", "input grad", "A grad", "B grad"), *results, strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=1e-6, msg=name)
        assert new.abs().max() > 1e-3, name  # not vacuous: every compared tensor carries signal


def test_fused_add_in_place_returns_the_base_tensor_and_gradients_flow_through_it():
    x, w, a, b = _layer(2)
    base = F.linear(x, w)
    y = _AddScaledLinear.apply(base, F.linear(x, a), b, SCALE)
    assert y.data_ptr() == base.data_ptr()  # written into the base output: no copy
    y.sum().backward()
    assert x.grad is not None and a.grad is not None and b.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("view", [False, True], ids=["in-place", "out-of-place"])
def test_at_init_b_zero_gives_the_base_exactly(dtype, view):
    x, w, a, b = _layer(3, dtype, b_zero=True)
    with torch.no_grad():
        expected = F.linear(x, w)
        assert torch.equal(_run(x, w, a, b, fused=True, view=view), expected)


def test_no_scaling_or_adding_operator_is_left():
    x, w, a, b = _layer(4)
    base = F.linear(x, w).detach()  # the base's own ops are megatron's, not counted here
    h = F.linear(x, a)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = _AddScaledLinear.apply(base, h, b, SCALE)
        torch.autograd.grad(y, (h, b), torch.ones_like(y))
    ops = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    assert ops["aten::addmm_"] == 1 and ops["aten::addmm"] == 2, ops
    assert not {"aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::mm"} & set(ops), ops
