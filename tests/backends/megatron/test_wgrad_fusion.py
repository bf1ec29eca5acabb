"""megatron's gradient-accumulation fusion through torch's provider (wgrad_fusion.py), on CPU: the provider's
contract (the CPU reference path; the CUDA GEMM is test_wgrad_fusion_gpu.py's), where megatron finds it, and
a model's fp32 gradients with the fusion equal to those without."""

import pytest
import torch
from megatron.core.tensor_parallel import layers
from script_rows import run_script

from slime.backends.megatron import wgrad_fusion
from slime.errors import ConfigError


def operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 12, generator=g).to(dtype)  # [tokens, in]
    dy = torch.randn(37, 20, generator=g).to(dtype)  # [tokens, out]
    return x, dy, torch.randn(20, 12, generator=g)  # main_grad [out, in], fp32, already holding a gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulates_the_weight_gradient_into_fp32_main_grad(dtype):
    x, dy, main_grad = operands(dtype)
    before = main_grad.clone()
    expected = before.double() + dy.double().t() @ x.double()  # exact sum of the same bf16/fp32 operands
    wgrad_fusion.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-6, atol=1e-5)
    # today's unfused path rounds the bf16 gradient first: the fused sum is at least as close to the exact one
    unfused = before + (dy.t() @ x).float()
    assert (main_grad.double() - expected).abs().max() <= (unfused.double() - expected).abs().max()


def test_bf16_main_grad_variant():
    x, dy, main_grad = operands(torch.bfloat16)
    main_grad = main_grad.bfloat16()
    expected = main_grad.float() + dy.float().t() @ x.float()
    wgrad_fusion.wgrad_gemm_accum_fp16(x, dy, main_grad)
    torch.testing.assert_close(main_grad.float(), expected, rtol=1e-2, atol=5e-2)  # one bf16 rounding


def test_install_puts_the_provider_where_megatron_looks(monkeypatch):
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", None, raising=False)
    assert wgrad_fusion.install()
    assert layers.fused_weight_gradient_mlp_cuda is wgrad_fusion.PROVIDER and layers._grad_accum_fusion_available
    assert wgrad_fusion.install()  # idempotent
    apex = object()  # Apex's extension, where installed, is left in place
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", apex)
    assert not wgrad_fusion.install() and layers.fused_weight_gradient_mlp_cuda is apex


def test_off_by_default_without_cuda():
    assert torch.cuda.is_available() or wgrad_fusion.available() is False


def test_deferred_embedding_wgrad_is_refused():
    with pytest.raises(ConfigError, match="defer_embedding_wgrad_compute"):
        wgrad_fusion.check_options({"gradient_accumulation_fusion": True, "defer_embedding_wgrad_compute": True})
    wgrad_fusion.check_options({"gradient_accumulation_fusion": False, "defer_embedding_wgrad_compute": True})


def test_fused_main_grads_match_the_unfused_model(tiny_kit):
    """fp32 on CPU: two micro-batches into megatron DDP's buffers, fused (the provider ran for every trainable
    linear weight of both) vs unfused (DDP's `main_grad += grad`)."""
    row = run_script("wgrad_parity.py", tiny_kit.model_dir, timeout=300)[0]
    assert row["fused_flag"] and not row["plain_flag"] and not row["default_flag"], row
    # every fused linear layer (qkv, proj, fc1, fc2 of each layer; the output layer) once per micro-batch
    assert row["plain_calls"] == 0 and row["fused_calls"] == 2 * row["fused_layers"] > 0, row
    assert row["max_gap"] <= 1e-6 * row["max_scale"] and row["grad_gap"] <= 1e-5 * row["grad_scale"], row
    assert row["bare_grads"] > 0  # a model without DDP trains its weights the unfused way
