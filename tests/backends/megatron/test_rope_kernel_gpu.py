"""rope_kernel's Triton rotation on CUDA (pytest -m gpu): where it applies, the same values as the compiled rotation
forward (bit for bit: both compute the sum of two exact fp32 products and round once) and within one rounding of
the exact rotation backward, for contiguous and strided inputs; megatron's provider uses it. The host time per call,
what the kernel is for, is bench/rope.py's."""

import pytest
import torch
from rope_reference import check_rounded_once, forward_backward, llama_inputs

from slime.backends.megatron import rope_fusion, rope_kernel

pytestmark = pytest.mark.gpu


def _compiled(t, freqs):
    return rope_fusion._compiled(t, *rope_fusion.cos_sin(freqs, t.dtype), False)


def _kernel(t, freqs):
    cos, sin = rope_fusion.cos_sin(freqs, t.dtype)
    assert rope_kernel.applies(t, cos, False)
    return rope_kernel.rotary(t, cos, sin)


def test_it_applies_only_where_it_computes_the_rotation():
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    t, freqs, _ = llama_inputs(64, 4, device="cuda")
    cos, _ = rope_fusion.cos_sin(freqs, t.dtype)
    assert rope_kernel.applies(t, cos, False)
    assert not rope_kernel.applies(t, cos, True)  # interleaved pairs
    assert not rope_kernel.applies(t.cpu(), cos.cpu(), False)
    assert not rope_kernel.applies(t, cos[..., :64], False)  # partial rotary
    assert not rope_kernel.applies(t[..., :80], cos[..., :80], False)  # half 40: not a power of two
    assert not rope_kernel.applies(t, cos.expand(64, 2, 1, 128), False)  # angles per sample


@pytest.mark.parametrize("heads", [12, 2])  # Qwen2 1.5B: 12 query heads, 2 key/value heads of 128
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_kernel_matches_the_compiled_rotation(heads, layout):
    t, freqs, grad = llama_inputs(4096, heads, device="cuda")
    if layout == "strided":  # a view into a wider tensor, as megatron's query/key are views of the QKV output
        wide = torch.randn(4096, 1, heads, 3 * 128, device="cuda").to(t.dtype)
        wide[..., 128:256] = t
        t = wide[..., 128:256]
        assert not t.is_contiguous()
    out, dx = forward_backward(_kernel, t, freqs, grad)
    ref_out, ref_dx = forward_backward(_compiled, t, freqs, grad)
    assert torch.equal(out, ref_out)
    unit = torch.finfo(t.dtype).eps / 2
    gap = (dx.double() - ref_dx.double()).abs()
    assert bool((gap <= 2 * unit * ref_dx.double().abs() + 2 ** -20).all()), gap.max().item()
    print({"heads": heads, "layout": layout, "backward_equal": bool(torch.equal(dx, ref_dx)),
           "backward_max_gap": gap.max().item()})


@pytest.mark.parametrize("heads", [12, 2])
def test_the_provider_uses_it_and_stays_within_one_rounding_of_the_exact_rotation(heads, monkeypatch):
    calls = []
    monkeypatch.setattr(rope_kernel, "rotary", lambda *a, _f=rope_kernel.rotary: calls.append(1) or _f(*a))
    t, freqs, grad = llama_inputs(4096, heads, device="cuda")
    errors = check_rounded_once(t, freqs, grad)  # through rope_fusion.fused_apply_rotary_pos_emb
    assert calls, "the provider did not use the kernel"
    print({"heads": heads, "max_abs_error": errors})
