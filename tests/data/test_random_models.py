"""Random real-shape checkpoints: the shapes benchmarks and GPU tests rely on."""

import pytest
import torch

from slime.data.random_models import qwen2_config


def test_qwen2_sizes_have_their_parameter_counts():
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        counts = {size: sum(p.numel() for p in Qwen2ForCausalLM(qwen2_config(size)).parameters())
                  for size in ("0.5b", "1.5b", "3b", "7b", "14b")}
    # the published Qwen2.5 sizes (tied embeddings counted once up to 3B; 7B and 14B have their own output layer)
    assert counts == {"0.5b": 494_032_768, "1.5b": 1_543_714_304, "3b": 3_085_938_688, "7b": 7_615_616_512,
                      "14b": 14_770_033_664}


def test_unknown_size_is_refused():
    with pytest.raises(ValueError, match="unknown Qwen2 size '70b'"):
        qwen2_config("70b")


def test_qwen3_moe_scaled_shape_is_qwen3_30b_a3b_per_layer():
    from transformers import Qwen3MoeForCausalLM

    from slime.data.random_models import qwen3_moe_config

    config = qwen3_moe_config("30b-a3b-scaled", num_hidden_layers=48)  # the published model's depth
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    # Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated (8 of 128 experts; "3.3B" truncates 3.35B)
    assert total == 30_532_122_624 and 3.3e9 < active < 3.4e9, (total, active)
    assert qwen3_moe_config("30b-a3b-scaled").num_hidden_layers == 4


def test_tiny_qwen3_moe_is_written_expert_by_expert(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from slime.data.random_models import save_random_qwen3_moe
    from slime.data.tiny import build_tokenizer

    out = save_random_qwen3_moe(tmp_path / "moe", "tiny", seed=3)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "qwen3_moe" and config.norm_topk_prob and config.mlp_only_layers == []
    weights = load_file(out / "model.safetensors")
    # the published layout: one tensor per expert and projection, not transformers 5's fused in-memory ones
    assert weights["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert not any(name.endswith("gate_up_proj") for name in weights)
    assert weights["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    assert len(AutoTokenizer.from_pretrained(out)) == len(build_tokenizer()) == config.vocab_size
    again = load_file(save_random_qwen3_moe(tmp_path / "again", "tiny", seed=3) / "model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)  # seeded


def test_unknown_qwen3_moe_size_is_refused():
    from slime.data.random_models import qwen3_moe_config

    with pytest.raises(ValueError, match="unknown Qwen3-MoE size '235b'"):
        qwen3_moe_config("235b")
