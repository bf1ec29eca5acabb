"""megatron's rotary fusion through torch's provider (rope_fusion.py) on CPU: the eager function computes
megatron's unfused rotary embedding bit for bit, the compiled one within rounding, megatron finds the
provider, and the model's logits and gradients with the fusion equal the unfused model's."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from rope_reference import check_rounded_once, llama_inputs
from script_rows import run_script

from slime.backends.megatron import rope_fusion


def inputs(dtype: torch.dtype, rot_dim: int, head_dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """t [seq, batch, heads, head_dim] and megatron's freqs [seq, 1, 1, rot_dim] (RotaryEmbedding's layout)."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(11, 2, 3, head_dim, generator=g).to(dtype).requires_grad_()
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    angles = torch.outer(torch.arange(11).float(), inv)
    return t, torch.cat((angles, angles), dim=-1)[:, None, None, :]


def forward_backward(fn, t: torch.Tensor, freqs: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.detach().clone().requires_grad_()
    out = fn(t, freqs, **kw)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype))
    return out.detach(), t.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 8])  # all channels rotated; a partial rotation with an unrotated tail
@pytest.mark.parametrize("interleaved", [False, True])
def test_eager_rotary_is_megatrons_bit_for_bit(dtype, rot_dim, interleaved):
    t, freqs = inputs(dtype, rot_dim)
    ours = forward_backward(rope_fusion.rotary, t, freqs, interleaved=interleaved)
    theirs = forward_backward(rope_utils._apply_rotary_pos_emb_bshd, t, freqs, rotary_interleaved=interleaved)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert not torch.equal(ours[0], t)  # it does rotate


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_compiled_rotary_matches_megatrons(dtype, tol):
    """Compiled (inductor's C++ backend here), the intermediate products are not rounded to bf16: within one
    bf16 rounding of megatron's values, forward and backward, at a small shape."""
    t, freqs = inputs(dtype, 16)
    ours = forward_backward(rope_fusion.fused_apply_rotary_pos_emb, t, freqs)
    theirs = forward_backward(rope_utils._apply_rotary_pos_emb_bshd, t, freqs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_compiled_rotary_is_the_exact_rotation_rounded_once():
    """At a Qwen2 shape (512 positions, theta 1e6, 128 channels) the two products cancel somewhere: there the
    compiled rotation and megatron's differ by more than a rounding of the result (this once failed the GPU test
    comparing the two), but the compiled output is within one bf16 rounding of the exact rotation, and megatron's
    is not closer to it, forward or backward (the check test_rope_fusion_gpu.py makes on CUDA at 4096)."""
    t, freqs, grad = llama_inputs(512, 4)
    errors = check_rounded_once(t, freqs, grad)
    assert errors["out_megatron"] > errors["out_ours"], errors  # megatron's three roundings show at this size


def test_install_puts_the_provider_where_megatron_looks(monkeypatch):
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    assert rope_fusion.install() and rope_utils.fused_apply_rotary_pos_emb is rope_fusion.fused_apply_rotary_pos_emb
    assert rope_fusion.install()  # idempotent
    te_kernel = object()  # Transformer Engine's, where installed, is left in place
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te_kernel)
    assert not rope_fusion.install() and rope_utils.fused_apply_rotary_pos_emb is te_kernel


def test_fused_rope_model_matches_the_unfused_model(tiny_kit):
    row = run_script("rope_parity.py", tiny_kit.model_dir, timeout=600)[0]
    assert row["fused_flag"] and not row["plain_flag"], row  # the option reached the model's config
    assert row["fused_calls"] == 2 * row["layers"] and row["plain_calls"] == 0, row  # query and key of each layer
    assert row["logit_gap"] < 1e-6 * row["logit_scale"], row
    assert row["grad_gap"] < 1e-6 * row["grad_scale"], row
    assert row["available"] is False  # CPU: the bridge keeps it off by default


def test_cached_cos_sin_gives_the_uncached_rotation_bit_for_bit_and_computes_once(monkeypatch):
    """cos/sin once per angle table and dtype: the same outputs and gradients as computing them every call;
    a table changed in place, or another dtype, is computed anew."""
    calls = []
    real = rope_fusion.cos_sin
    monkeypatch.setattr(rope_fusion, "cos_sin", lambda freqs, dtype: calls.append(dtype) or real(freqs, dtype))
    t, freqs = inputs(torch.bfloat16, 16)
    plain = forward_backward(rope_fusion.fused_apply_rotary_pos_emb_uncached, t, freqs)
    calls.clear()
    for _ in range(3):  # three layers' queries (or keys) with the same freqs
        cached = forward_backward(rope_fusion.fused_apply_rotary_pos_emb, t, freqs)
        assert torch.equal(cached[0], plain[0]) and torch.equal(cached[1], plain[1])
    assert calls == [torch.bfloat16]
    forward_backward(rope_fusion.fused_apply_rotary_pos_emb, t.float(), freqs)
    assert calls == [torch.bfloat16, torch.float32]
    freqs.mul_(2.0)  # a changed table is not served from the cache
    doubled = forward_backward(rope_fusion.fused_apply_rotary_pos_emb, t, freqs)
    assert calls[-1] == torch.bfloat16 and len(calls) == 3
    assert torch.equal(doubled[0], forward_backward(rope_fusion.fused_apply_rotary_pos_emb_uncached, t, freqs)[0])


def test_install_can_choose_the_uncached_provider(monkeypatch):
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    assert rope_fusion.install(cache_cos_sin=False)
    assert rope_utils.fused_apply_rotary_pos_emb is rope_fusion.fused_apply_rotary_pos_emb_uncached
    assert rope_fusion.install()  # and back: both are ours
    assert rope_utils.fused_apply_rotary_pos_emb is rope_fusion.fused_apply_rotary_pos_emb


def test_install_can_choose_the_eager_rotation_which_is_megatrons(monkeypatch):
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    with pytest.raises(ValueError, match="'fast' is not one of"):
        rope_fusion.install(kernel="fast")
    assert rope_fusion.install(kernel="compiled")
    assert rope_utils.fused_apply_rotary_pos_emb is rope_fusion.compiled_apply_rotary_pos_emb
    assert rope_fusion.install(kernel="eager")
    assert rope_utils.fused_apply_rotary_pos_emb is rope_fusion.eager_apply_rotary_pos_emb
    t = torch.randn(8, 2, 3, 16, dtype=torch.bfloat16)
    freqs = torch.randn(8, 1, 1, 16)
    # eager, cos/sin cached: megatron's unfused rotation bit for bit
    assert torch.equal(rope_fusion.eager_apply_rotary_pos_emb(t, freqs),
                       rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False))
    assert rope_fusion.install()  # and back to the compiled one
    assert rope_utils.fused_apply_rotary_pos_emb is rope_fusion.fused_apply_rotary_pos_emb
