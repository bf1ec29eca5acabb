"""swiglu_kernel's place in megatron's MLP, on the CPU: installed where the MLP looks `bias_swiglu_impl` up, falling
back to megatron's own function off CUDA (the same values), and removable for an A/B. The kernel itself runs on
CUDA only: test_swiglu_kernel_gpu.py."""

import torch
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer import mlp

from slime.backends.megatron import swiglu_kernel


def test_install_routes_megatrons_mlp_and_falls_back_off_cuda():
    swiglu_kernel.install()
    try:
        assert mlp.bias_swiglu_impl is swiglu_kernel.bias_swiglu_impl and swiglu_kernel.installed()
        swiglu_kernel.install()  # idempotent: megatron's original is kept, not our own function
        y = torch.randn(5, 2, 16, requires_grad=True)
        assert not swiglu_kernel.applies(y, None, False, False)  # a CPU tensor
        out = mlp.bias_swiglu_impl(y, None)
        out.sum().backward()
        ours = y.grad.clone()
        y.grad = None
        expected = fused_bias_swiglu.bias_swiglu_impl(y, None)
        expected.sum().backward()
        assert out.shape == (5, 2, 8) and torch.equal(out, expected) and torch.equal(ours, y.grad)
        swiglu_kernel.install(False)
        assert mlp.bias_swiglu_impl is fused_bias_swiglu.bias_swiglu_impl and not swiglu_kernel.installed()
    finally:
        swiglu_kernel.install()
