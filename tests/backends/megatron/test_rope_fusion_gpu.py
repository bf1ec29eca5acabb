"""megatron's rotary fusion through torch's provider on CUDA in bf16 (pytest -m gpu): the compiled rotation at
the 1.5B query/key shapes against megatron's unfused one, forward and backward; prints both timings."""

import time

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from slime.backends.megatron import rope_fusion
from slime.backends.megatron.bridge import fused_activation_available

pytestmark = pytest.mark.gpu


def _fwd_bwd(fn, t, freqs, grad):
    t = t.detach().clone().requires_grad_()
    out = fn(t, freqs)
    out.backward(grad)
    return out.detach(), t.grad


@pytest.mark.parametrize("heads", [12, 2])  # Qwen2 1.5B: 12 query heads, 2 key/value heads of 128
def test_compiled_rotary_matches_megatrons_on_cuda(heads):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    assert fused_activation_available()
    g = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(4096, 1, heads, 128, device="cuda", generator=g).bfloat16()
    inv = 1.0 / (1000000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    angles = torch.outer(torch.arange(4096, device="cuda").float(), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    grad = torch.randn(t.shape, device="cuda", generator=g).bfloat16()
    ours = _fwd_bwd(rope_fusion.fused_apply_rotary_pos_emb, t, freqs, grad)
    theirs = _fwd_bwd(rope_utils._apply_rotary_pos_emb_bshd, t, freqs, grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=2 ** -7)  # one bf16 rounding
    timings = {}
    for name, fn in (("fused", rope_fusion.fused_apply_rotary_pos_emb), ("megatron", rope_utils._apply_rotary_pos_emb_bshd)):
        for _ in range(3):
            _fwd_bwd(fn, t, freqs, grad)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            _fwd_bwd(fn, t, freqs, grad)
        torch.cuda.synchronize()
        timings[name] = (time.perf_counter() - start) / 50 * 1e3
    print({"heads": heads, "ms_fwd_bwd": timings})
