"""Run in a subprocess by test_bridge_fusions.py: the tiny model's logits and gradients with megatron's
fused SwiGLU (`bias_activation_fusion`, torch.compile'd; inductor's C++ backend on CPU) equal the
unfused ones, so turning it on where CUDA has Triton changes no numerics beyond rounding.

    python fusion_parity.py HF_DIR   -> prints one JSON line {logit_gap, grad_gap, fused, ...}
"""

import json
import sys

from megatron.core.fusions import fused_bias_swiglu
from option_parity import logits_and_grads

from slime.backends.megatron.bridge import fused_activation_available, init_megatron


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    calls = []
    compiled = fused_bias_swiglu.swiglu  # what SwiGLUFunction runs: count that the fused path is taken
    fused_bias_swiglu.swiglu = lambda y: calls.append(1) or compiled(y)
    plain, plain_grads, plain_config = logits_and_grads(hf_dir, {})
    plain_calls = len(calls)
    fused, fused_grads, fused_config = logits_and_grads(hf_dir, {"bias_activation_fusion": True})
    plain_flag, fused_flag = bool(plain_config.bias_activation_fusion), bool(fused_config.bias_activation_fusion)
    assert plain_grads.keys() == fused_grads.keys()
    print(json.dumps({"logit_gap": (plain - fused).abs().max().item(), "logit_scale": plain.abs().max().item(),
                      "grad_gap": max((plain_grads[k] - fused_grads[k]).abs().max().item() for k in plain_grads),
                      "grads": len(plain_grads), "plain_calls": plain_calls, "fused_calls": len(calls) - plain_calls,
                      "plain_flag": plain_flag, "fused_flag": fused_flag,
                      "available": fused_activation_available()}), flush=True)


if __name__ == "__main__":
    main()
