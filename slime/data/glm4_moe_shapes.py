"""GLM-4.5 (`glm4_moe`) configs of real and CPU-sized shapes, and its expert bias drawn at random: what
random_models' GLM-4.5 checkpoints (benchmarks, GPU and trainer/engine tests) and the tiny kit's GLM-4.5 recipe
(`model.moe.model_type: glm4_moe`, slime/data/tiny.py) are both built from. No heavy import at module level: the tiny
kit's recipe module imports this one."""

from __future__ import annotations

from typing import Any

# GLM-4.5 (glm4_moe): a CPU-sized "tiny" with every GLM-4.5 trait (a first dense layer, a shared expert, sigmoid
# routing with an expert bias over 2 groups of 4 experts, routed_scaling_factor, half-rotary heads, q/k norm,
# qkv biases; no MTP layer) and GLM-4.5-Air's per-layer dimensions with 4 of its 46 layers, for GPU work
GLM4_MOE_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                 n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                 use_qk_norm=True, attention_bias=True, vocab_size=260, tie_word_embeddings=False,
                 rms_norm_eps=1e-5, num_nextn_predict_layers=0),
    "air-scaled": dict(hidden_size=4096, num_hidden_layers=4, num_attention_heads=96, num_key_value_heads=8,
                       head_dim=128, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
                       num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                       routed_scaling_factor=1.0, use_qk_norm=False, attention_bias=True, vocab_size=151552,
                       tie_word_embeddings=False, rms_norm_eps=1e-5, num_nextn_predict_layers=0),
}


def glm4_moe_config(size: str, max_position_embeddings: int = 4096, **overrides: Any) -> Any:
    """The `Glm4MoeConfig` of a `GLM4_MOE_SHAPES` size: top-k weights renormalised, half of each head rotated
    (`partial_rotary_factor` 0.5, as GLM-4.5 ships), rope theta 1e6."""
    from transformers import Glm4MoeConfig

    if size not in GLM4_MOE_SHAPES:
        raise ValueError(f"unknown GLM-4.5 size {size!r}; known: {', '.join(GLM4_MOE_SHAPES)}")
    options = dict(max_position_embeddings=max_position_embeddings, norm_topk_prob=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
                   **GLM4_MOE_SHAPES[size])
    return Glm4MoeConfig(**{**options, **overrides})


def draw_expert_bias(model: Any, scale: float) -> None:
    """Draw every MoE layer's expert bias (`mlp.gate.e_score_correction_bias`, zeros at init) of a GLM-4.5 model
    from N(0, scale^2), from torch's global RNG, layer by layer."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * scale)
