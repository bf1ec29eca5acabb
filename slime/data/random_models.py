"""Random-weight Hugging Face checkpoints of real model shapes, for benchmarks and GPU tests.

Throughput, memory and numerical-parity figures depend on a model's shape, not on its weights, so
benchmarks and GPU tests build Qwen2.5-shaped models with random weights instead of downloading
them. The tokenizer is the tiny kit's (token ids it does not know decode to nothing, which does not
matter for these uses).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from slime.data.glm4_moe_shapes import GLM4_MOE_SHAPES, draw_expert_bias, glm4_moe_config

__all__ = ["GLM4_MOE_SHAPES", "QWEN2_SHAPES", "QWEN3_MOE_SHAPES", "draw_expert_bias", "glm4_moe_config",
           "qwen2_config", "qwen3_moe_config", "save_random_glm4_moe", "save_random_qwen2", "save_random_qwen3_moe"]

QWEN2_SHAPES: dict[str, dict[str, Any]] = {  # Qwen2.5 0.5B to 14B (the larger ones: what only LoRA fits on one GPU)
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=13824, vocab_size=152064, tie_word_embeddings=False),
}


def qwen2_config(size: str, max_position_embeddings: int = 4096) -> Any:
    """The `Qwen2Config` of a Qwen2.5 model size (a key of `QWEN2_SHAPES`)."""
    from transformers import Qwen2Config

    if size not in QWEN2_SHAPES:
        raise ValueError(f"unknown Qwen2 size {size!r}; known: {', '.join(QWEN2_SHAPES)}")
    return Qwen2Config(max_position_embeddings=max_position_embeddings, **QWEN2_SHAPES[size])


def save_random_qwen2(out_dir: str | Path, size: str = "0.5b", dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0, max_position_embeddings: int = 4096) -> Path:
    """Write a seeded random-weight Qwen2 of `size` with the tiny kit's tokenizer to `out_dir`."""
    from transformers import Qwen2ForCausalLM

    from slime.data.tiny import build_tokenizer

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qwen2_config(size, max_position_embeddings)).to(dtype)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return Path(out_dir)


# Qwen3-MoE: a CPU-sized "tiny" (every layer sparse, 8 experts, top-2, a vocabulary that Megatron pads) and
# Qwen3-30B-A3B's per-layer dimensions with 4 of its 48 layers, for GPU work on one card
QWEN3_MOE_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 vocab_size=260, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "30b-a3b-scaled": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                           num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6),
}


def qwen3_moe_config(size: str, max_position_embeddings: int = 4096, **overrides: Any) -> Any:
    """The `Qwen3MoeConfig` of a `QWEN3_MOE_SHAPES` size: every layer sparse, top-k weights renormalised
    (`norm_topk_prob`, as Qwen3-30B-A3B ships; transformers' default is False), rope theta 1e6."""
    from transformers import Qwen3MoeConfig

    if size not in QWEN3_MOE_SHAPES:
        raise ValueError(f"unknown Qwen3-MoE size {size!r}; known: {', '.join(QWEN3_MOE_SHAPES)}")
    options = dict(max_position_embeddings=max_position_embeddings, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                   **QWEN3_MOE_SHAPES[size])
    return Qwen3MoeConfig(**{**options, **overrides})


def save_random_qwen3_moe(out_dir: str | Path, size: str = "tiny", dtype: torch.dtype = torch.float32,
                          seed: int = 0, max_position_embeddings: int = 4096, **overrides: Any) -> Path:
    """Write a seeded random-weight Qwen3-MoE of `size` (config fields in `overrides`) with the tiny kit's
    tokenizer to `out_dir`, experts one tensor each (`mlp.experts.{e}.gate_proj.weight`, ...) as the published
    checkpoints hold them: transformers 5 fuses them in memory and splits them again on save."""
    from transformers import Qwen3MoeForCausalLM

    from slime.data.tiny import build_tokenizer

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(qwen3_moe_config(size, max_position_embeddings, **overrides)).to(dtype)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return Path(out_dir)


def save_random_glm4_moe(out_dir: str | Path, size: str = "tiny", dtype: torch.dtype = torch.float32,
                         seed: int = 0, max_position_embeddings: int = 4096, bias_scale: float = 0.1,
                         **overrides: Any) -> Path:
    """Write a seeded random-weight GLM-4.5-style model of `size` with the tiny kit's tokenizer to `out_dir`.
    Each MoE layer's expert bias (`mlp.gate.e_score_correction_bias`, zeros at init) is drawn from
    N(0, bias_scale^2), so the bias changes which experts are picked, as a trained GLM-4.5's does. With
    `num_nextn_predict_layers=N` in `overrides` the checkpoint also holds N random MTP layers after the decoder's,
    as GLM-4.5's does (transformers does not build them; `_add_random_mtp_layers`)."""
    from transformers import Glm4MoeForCausalLM

    from slime.data.tiny import build_tokenizer

    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(glm4_moe_config(size, max_position_embeddings, **overrides)).to(dtype)
    draw_expert_bias(model, bias_scale)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    if model.config.num_nextn_predict_layers:
        _add_random_mtp_layers(Path(out_dir), model.config, dtype)
    return Path(out_dir)


def _add_random_mtp_layers(out_dir: Path, config: Any, dtype: torch.dtype) -> None:
    """GLM-4.5's MTP layers, which transformers does not build: `model.layers.{num_hidden_layers + i}.*` holding
    enorm, hnorm, eh_proj, shared_head.norm and a whole MoE decoder layer (random: a copy of the last decoder
    layer's tensors plus noise), written into the checkpoint as the published ones hold them."""
    weights = load_file(str(out_dir / "model.safetensors"))
    last, hidden = config.num_hidden_layers - 1, config.hidden_size
    for i in range(config.num_nextn_predict_layers):
        prefix = f"model.layers.{config.num_hidden_layers + i}."
        for name, tensor in list(weights.items()):
            if name.startswith(f"model.layers.{last}."):
                weights[prefix + name.removeprefix(f"model.layers.{last}.")] = (
                    tensor + 0.01 * torch.randn(tensor.shape)).to(tensor.dtype)
        weights[prefix + "enorm.weight"] = torch.ones(hidden, dtype=dtype)
        weights[prefix + "hnorm.weight"] = torch.ones(hidden, dtype=dtype)
        weights[prefix + "eh_proj.weight"] = (0.02 * torch.randn(hidden, 2 * hidden)).to(dtype)
        weights[prefix + "shared_head.norm.weight"] = torch.ones(hidden, dtype=dtype)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
