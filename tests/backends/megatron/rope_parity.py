"""Run in a subprocess by test_rope_fusion.py: the tiny model's logits and gradients with megatron's rotary
fusion (`apply_rope_fusion`) through torch's provider (rope_fusion.py, torch.compile'd; inductor's C++ backend
on CPU) equal the unfused model's.

    python rope_parity.py HF_DIR   -> prints one JSON line {logit_gap, grad_gap, fused_calls, ...}
"""

import json
import sys

from option_parity import logits_and_grads

from slime.backends.megatron import rope_fusion
from slime.backends.megatron.bridge import fused_activation_available, init_megatron


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    calls = []
    compiled = rope_fusion._compiled  # what the provider runs: count that the fused path is taken
    rope_fusion._compiled = lambda *a: calls.append(1) or compiled(*a)
    plain, plain_grads, plain_config = logits_and_grads(hf_dir, {})
    plain_calls = len(calls)
    fused, fused_grads, fused_config = logits_and_grads(hf_dir, {"apply_rope_fusion": True})
    assert plain_grads.keys() == fused_grads.keys()
    print(json.dumps({"logit_gap": (plain - fused).abs().max().item(), "logit_scale": plain.abs().max().item(),
                      "grad_gap": max((plain_grads[k] - fused_grads[k]).abs().max().item() for k in plain_grads),
                      "grad_scale": max(g.abs().max().item() for g in plain_grads.values()),
                      "layers": fused_config.num_layers, "plain_calls": plain_calls,
                      "fused_calls": len(calls) - plain_calls, "plain_flag": bool(plain_config.apply_rope_fusion),
                      "fused_flag": bool(fused_config.apply_rope_fusion), "available": fused_activation_available()}),
          flush=True)


if __name__ == "__main__":
    main()
