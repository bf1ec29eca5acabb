"""The formulas the slot decoder fuses on CUDA equal the `transformers` modules they replace (eager,
on CPU; the compiled kernels are checked end to end by the GPU log-prob test)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engines.builtin.slots import SlotDecoder, add_rms_norm, silu_mul


@pytest.fixture(scope="module")
def model(tiny_kit):
    return AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_residual_add_then_the_models_norm(model, dtype):
    norm = copy.deepcopy(model.model.layers[0].post_attention_layernorm).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)  # not all ones, so the weight's place in the formula matters
    residual, delta = (torch.randn(4, 1, model.config.hidden_size, dtype=dtype) for _ in range(2))
    hidden, normed = add_rms_norm(residual, delta, norm.weight, norm.variance_epsilon)
    assert torch.equal(hidden, residual + delta)
    assert torch.equal(normed, norm(residual + delta))


def test_silu_mul_is_the_models_mlp_activation(model):
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 1, model.config.hidden_size)
    assert torch.equal(mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x))), mlp(x))


def test_fusion_is_cuda_graph_only(model):
    decoder = SlotDecoder(model, slots=2, max_len=32, device=torch.device("cpu"), cuda_graphs=True)
    assert not decoder.fused and not decoder.cuda_graphs  # CPU: the modules run eagerly, nothing is compiled
