"""Gradient-accumulation fusion through torch's provider on CUDA in bf16 (pytest -m gpu): the provider's GEMM
against the fp32 reference and today's unfused path, and a random 0.5B-shaped model's DDP `main_grad`s with
and without the fusion."""

import pytest
import torch
from script_rows import run_script

from slime.backends.megatron import wgrad_fusion
from slime.data.random_models import save_random_qwen2

pytestmark = pytest.mark.gpu


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")


def test_the_cuda_gemm_accumulates_in_fp32_like_apex():
    """1.5B fc1 shape, one 4096-token micro-batch onto a main_grad that already holds one: the fused result is the
    exact sum of the bf16 products up to fp32 summation order; the unfused one also carries the bf16 rounding of
    the micro-batch's gradient."""
    _cuda()
    assert wgrad_fusion.available()  # torch here has the bf16 -> fp32 GEMM and it accumulates
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1536, device="cuda", generator=g).bfloat16()
    dy = (torch.randn(4096, 8960, device="cuda", generator=g) * 1e-3).bfloat16()
    main_grad = torch.randn(8960, 1536, device="cuda", generator=g) * 0.05
    before = main_grad.clone()
    exact = before.double() + dy.double().t() @ x.double()
    wgrad_fusion.wgrad_gemm_accum_fp32(x, dy, main_grad)
    unfused = before + (dy.t() @ x).float()  # megatron without the fusion: bf16 wgrad, then DDP's fp32 add
    fused_err = (main_grad.double() - exact).abs().max().item()
    unfused_err = (unfused.double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    print({"fused_err": fused_err, "unfused_err": unfused_err, "scale": scale})
    assert fused_err < 1e-5 * scale
    assert fused_err < unfused_err


def test_model_main_grads_match_the_unfused_path(tmp_path):
    _cuda()
    save_random_qwen2(tmp_path / "hf", "0.5b")
    row = run_script("wgrad_parity.py", tmp_path / "hf", "bf16", timeout=900)[0]
    print(row)
    assert row["default_flag"] and row["fused_flag"] and not row["plain_flag"], row  # on by default on CUDA
    assert row["plain_calls"] == 0 and row["fused_calls"] == 2 * row["fused_layers"] > 0, row
    # the unfused path rounds each micro-batch's weight gradient to bf16 (2^-9 relative) before adding it
    assert row["grad_gap"] <= 1e-2 * row["grad_scale"], row
    assert row["bare_grads"] > 0
