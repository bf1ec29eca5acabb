"""swiglu_kernel's Triton SwiGLU on CUDA (pytest -m gpu) against megatron's compiled one (`SwiGLUFunction`, what
`bias_activation_fusion` runs) at the 0.5B and 1.5B MLP widths, bf16, forward and backward: within one bf16 rounding
of it everywhere (the two differ at most in the last bit of a sigmoid before rounding), and no further from the
fp64 values than it is."""

import pytest
import torch
from megatron.core.fusions import fused_bias_swiglu

from slime.backends.megatron import swiglu_kernel

pytestmark = pytest.mark.gpu


def _forward_backward(fn, y, grad):
    y = y.detach().clone().requires_grad_()
    out = fn(y)
    out.backward(grad)
    return out.detach(), y.grad


@pytest.mark.parametrize("width", [4864, 8960])  # Qwen2 0.5B and 1.5B intermediate sizes
def test_kernel_matches_megatrons_compiled_swiglu(width):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    y = (3 * torch.randn(4096, 1, 2 * width, device="cuda", generator=g)).bfloat16()
    grad = torch.randn(4096, 1, width, device="cuda", generator=g).bfloat16()
    assert swiglu_kernel.applies(y, None, False, False)
    ours = _forward_backward(swiglu_kernel.swiglu, y, grad)
    theirs = _forward_backward(lambda v: fused_bias_swiglu.bias_swiglu_impl(v, None), y, grad)

    def exact(v: torch.Tensor) -> torch.Tensor:
        v1, v2 = v.chunk(2, -1)
        return torch.nn.functional.silu(v1) * v2

    reference = _forward_backward(exact, y.double(), grad.double())
    unit = torch.finfo(torch.bfloat16).eps / 2
    report = {"width": width}
    for name, a, b, e in zip(("out", "grad"), ours, theirs, reference, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        gap = (a.double() - b.double()).abs()
        assert bool((gap <= 2 * unit * b.double().abs() + 2 ** -24).all()), (name, gap.max().item())
        err_ours, err_theirs = (a.double() - e).abs().max().item(), (b.double() - e).abs().max().item()
        assert err_ours <= 1.01 * err_theirs + 2 ** -24, (name, err_ours, err_theirs)
        report[name] = {"equal_fraction": (a == b).float().mean().item(), "max_gap": gap.max().item(),
                        "max_error_ours": err_ours, "max_error_megatron": err_theirs}
    print(report)
