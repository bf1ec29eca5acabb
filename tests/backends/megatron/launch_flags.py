"""Run in a subprocess by test_launch_flags.py (megatron's parallel state is per process): Megatron-LM's
model-shaping launch flags (--rotary-percent & co., slime/config/megatron_flags.py) are checked against the checkpoint
when the bridge is made: an agreeing value builds, another is refused naming the flag and the checkpoint's value.

    python launch_flags.py HF_DIR   -> prints one JSON line per case
"""

import json
import sys

from slime.backends.megatron.bridge import init_megatron, make_bridge
from slime.config.megatron_flags import renamed_options
from slime.errors import ConfigError

CASES = {
    "agree": {"rotary_percent": 1.0, "use_rope_scaling": False, "apply_layernorm_1p": False, "num_experts": None,
              "use_dist_ckpt": True, "accumulate_allreduce_grads_in_fp32": True},
    "rotary_percent": {"rotary_percent": 0.5},
    "use_rope_scaling": {"use_rope_scaling": True},
    "apply_layernorm_1p": {"apply_layernorm_1p": True},
    "num_experts": {"num_experts": 8},
    "fp8": {"fp8_format": "e4m3", "fp8_recipe": "blockwise"},  # as the config hands it over: renamed to fp8
}


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    for case, megatron in CASES.items():
        try:
            bridge = make_bridge(hf_dir, megatron=renamed_options(megatron))
            row = {"case": case, "refused": None, "num_layers": bridge.config.num_layers}
        except ConfigError as exc:
            row = {"case": case, "refused": str(exc)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
