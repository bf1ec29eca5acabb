"""Run in a subprocess by test_model_options.py (megatron's parallel state is per process): the megatron
section's TransformerConfig options reach the model (activation recompute on the tiny model, with the same
logits and gradients as without), and a shape flag must agree with the checkpoint.

    python model_options.py HF_DIR   -> prints one JSON line
"""

import json
import sys

from megatron.core import tensor_parallel
from option_parity import logits_and_grads

from slime.backends.megatron.bridge import init_megatron, make_bridge, model_options
from slime.errors import ConfigError

MEGATRON = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
            "hidden_dropout": 0.0, "tensor_model_parallel_size": 1, "lr_decay_style": "cosine"}


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    calls = []
    checkpoint = tensor_parallel.checkpoint  # what megatron's full recompute runs each layer through
    tensor_parallel.checkpoint = lambda *a, **k: calls.append(1) or checkpoint(*a, **k)
    plain, plain_grads, _ = logits_and_grads(hf_dir, {})
    plain_calls = len(calls)
    recomputed, grads, config = logits_and_grads(hf_dir, MEGATRON)
    layers = config.num_layers
    try:
        make_bridge(hf_dir, megatron={"num_layers": layers + 1})
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    make_bridge(hf_dir, megatron={"num_layers": layers, "normalization": "RMSNorm"})  # agreeing shape flags pass
    print(json.dumps({"options": sorted(model_options(MEGATRON)), "recompute_granularity": config.recompute_granularity,
                      "plain_calls": plain_calls, "recompute_calls": len(calls) - plain_calls, "layers": layers,
                      "logit_gap": (plain - recomputed).abs().max().item(),
                      "grad_gap": max((plain_grads[k] - grads[k]).abs().max().item() for k in plain_grads),
                      "refused": refused}), flush=True)


if __name__ == "__main__":
    main()
