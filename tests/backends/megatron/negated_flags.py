"""Run in a subprocess by test_bridge_fusions.py (megatron's parallel state is per process): Megatron-LM's
`--no-X` fusion flags, read by load_config, turn the fusions off in the model's TransformerConfig. The fusions'
defaults are made "available" first (as on a CUDA machine with Triton), so that off differs from the default.

    python negated_flags.py HF_DIR   -> prints one JSON line: the fusion fields of a default and a flagged model
"""

import json
import sys

from slime.backends.megatron import bridge as bridge_module
from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.config import load_config

FLAGS = ["--no-gradient-accumulation-fusion", "--no-rope-fusion", "--no-masked-softmax-fusion",
         "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm"]
FIELDS = ["gradient_accumulation_fusion", "apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion",
          "bias_dropout_fusion", "persist_layer_norm"]


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    bridge_module.fused_activation_available = lambda: True  # the defaults a CUDA machine with Triton gets
    bridge_module.wgrad_fusion.available = lambda: True
    default = make_bridge(hf_dir, megatron=load_config(None, []).megatron).config
    megatron = load_config(None, FLAGS).megatron
    model = build_model(make_bridge(hf_dir, megatron=megatron), hf_dir)[0]
    print(json.dumps({"megatron": megatron, "default": {f: getattr(default, f) for f in FIELDS},
                      "flagged": {f: getattr(model.config, f) for f in FIELDS}}), flush=True)


if __name__ == "__main__":
    main()
