"""Run in a subprocess by test_bridge_fusions.py: the tiny model's logits and gradients with megatron's
fused SwiGLU (`bias_activation_fusion`, torch.compile'd; inductor's C++ backend on CPU) equal the
unfused ones, so turning it on where CUDA has Triton changes no numerics beyond rounding.

    python fusion_parity.py HF_DIR   -> prints one JSON line {logit_gap, grad_gap, fused, ...}
"""

import json
import sys

import torch
from megatron.core.fusions import fused_bias_swiglu

from slime.backends.megatron.bridge import build_model, fused_activation_available, init_megatron, make_bridge


def logits_and_grads(hf_dir: str, fused: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], bool]:
    bridge = make_bridge(hf_dir)
    if fused:
        bridge.set_extra_args(bias_activation_fusion=True)
    model = build_model(bridge, hf_dir)[0]
    tokens = torch.randint(0, bridge.hf_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).unsqueeze(0).expand_as(tokens)
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, bool(model.config.bias_activation_fusion)


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    calls = []
    compiled = fused_bias_swiglu.swiglu  # what SwiGLUFunction runs: count that the fused path is taken
    fused_bias_swiglu.swiglu = lambda y: calls.append(1) or compiled(y)
    plain, plain_grads, plain_flag = logits_and_grads(hf_dir, fused=False)
    plain_calls = len(calls)
    fused, fused_grads, fused_flag = logits_and_grads(hf_dir, fused=True)
    assert plain_grads.keys() == fused_grads.keys()
    print(json.dumps({"logit_gap": (plain - fused).abs().max().item(), "logit_scale": plain.abs().max().item(),
                      "grad_gap": max((plain_grads[k] - fused_grads[k]).abs().max().item() for k in plain_grads),
                      "grads": len(plain_grads), "plain_calls": plain_calls, "fused_calls": len(calls) - plain_calls,
                      "plain_flag": plain_flag, "fused_flag": fused_flag,
                      "available": fused_activation_available()}), flush=True)


if __name__ == "__main__":
    main()
