"""Models the slot decoder's tests run (imported as `from slot_models import ...`): the tiny kit's Qwen2 and random
Llama / Qwen3 models of another shape, in fp32 on CPU."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config


def tiny(tiny_kit):
    return AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()


def small(kind):
    """A random model of another family: Llama and Qwen3 have no projection biases, Qwen3 has q/k norms."""
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    config = LlamaConfig(**shape) if kind == "llama" else Qwen3Config(**shape, head_dim=16)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def build(tiny_kit, kind):
    """`kind` qwen2: the tiny kit's model; llama, qwen3: `small(kind)`."""
    return tiny(tiny_kit) if kind == "qwen2" else small(kind)
