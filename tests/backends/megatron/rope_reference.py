"""The accuracy check the rotary-fusion tests share (test_rope_fusion.py on CPU, test_rope_fusion_gpu.py on
CUDA): the compiled rotation against the exact (fp64) rotation of the same operands, forward and backward."""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

from slime.backends.megatron import rope_fusion


def forward_backward(fn, t: torch.Tensor, freqs: torch.Tensor, grad: torch.Tensor,
                     **kw) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.detach().clone().requires_grad_()
    out = fn(t, freqs, **kw)
    out.backward(grad)
    return out.detach(), t.grad


def llama_inputs(seq: int, heads: int, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cpu", theta: float = 1e6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t [seq, 1, heads, head_dim], megatron's freqs [seq, 1, 1, head_dim] (fp32 angles) and an output gradient."""
    g = torch.Generator(device=device).manual_seed(0)
    t = torch.randn(seq, 1, heads, head_dim, device=device, generator=g).to(dtype)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv)
    grad = torch.randn(t.shape, device=device, generator=g).to(dtype)
    return t, torch.cat((angles, angles), dim=-1)[:, None, None, :], grad


def check_rounded_once(t: torch.Tensor, freqs: torch.Tensor, grad: torch.Tensor) -> dict[str, float]:
    """Assert the compiled rotation against the exact rotation of the same operands (`t`, the cos/sin megatron
    casts to `t`'s dtype, `grad`): its output within one rounding (of `t`'s dtype) of the exact output; output and
    input gradient within the error bound of a rounded sum of rounded products, 2u(|v cos| + |v' sin|), as
    megatron's are; and neither further from the exact values than megatron's unfused rotation. Returns the
    largest errors of both."""
    cos, sin = rope_fusion.cos_sin(freqs, t.dtype)
    exact = forward_backward(lambda x, f: rope_fusion.rotate(x, cos.double(), sin.double()), t.double(), freqs,
                             grad.double())
    ours = forward_backward(rope_fusion.fused_apply_rotary_pos_emb, t, freqs, grad)
    theirs = forward_backward(rope_utils._apply_rotary_pos_emb_bshd, t, freqs, grad)
    unit = torch.finfo(t.dtype).eps / 2  # one rounding: 2^-8 in bf16
    half = t.shape[-1] // 2

    def magnitude(v: torch.Tensor) -> torch.Tensor:
        """|v cos| + |v' sin|, v' the halves swapped: the size of the two products summed, forward (v = t) and
        backward (v = grad; cos and sin repeat over the halves)."""
        v = v.double().abs()
        return v * cos.double().abs() + torch.cat((v[..., half:], v[..., :half]), dim=-1) * sin.double().abs()

    torch.testing.assert_close(ours[0].double(), exact[0], rtol=unit, atol=2 ** -20)  # the sum rounded once
    errors = {}
    for name, a, b, e, v in zip(("out", "grad"), ours, theirs, exact, (t, grad), strict=True):
        bound = 2 * unit * magnitude(v) + 2 ** -20
        for who, x in (("ours", a), ("megatron", b)):
            gap = (x.double() - e).abs()
            assert bool((gap <= bound).all()), (name, who, (gap / bound).max().item())
            errors[f"{name}_{who}"] = gap.max().item()
        assert errors[f"{name}_ours"] <= errors[f"{name}_megatron"], errors
    return errors
