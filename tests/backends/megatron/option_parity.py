"""One forward and backward of the model a checkpoint builds with given megatron options: what
fusion_parity.py and model_options.py compare (run as scripts, they import this module from their own
directory)."""

from typing import Any

import torch

from slime.backends.megatron.bridge import build_model, make_bridge


def logits_and_grads(hf_dir: str, megatron: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    """The logits of fixed random tokens, the parameters' gradients of a loss on them, and the model's config."""
    bridge = make_bridge(hf_dir, megatron=megatron)
    model = build_model(bridge, hf_dir)[0]
    tokens = torch.randint(0, bridge.hf_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).unsqueeze(0).expand_as(tokens)
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, model.config
