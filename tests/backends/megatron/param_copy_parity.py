"""Run in a subprocess by test_param_copy.py: megatron's bf16 optimizer copies its fp32 main parameters into the
model's bf16 parameters; the foreach copy (optimizer.use_foreach_param_copy, the default) and megatron's per-tensor
loop write the same bits.

    python param_copy_parity.py HF_DIR   -> one JSON line
"""

import json
import sys

import torch

from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.optimizer import _leaves, build_optimizer, use_foreach_param_copy


def model_params(models: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in models[0].parameters()]


def main() -> None:
    init_megatron(seed=0)
    bridge = make_bridge(sys.argv[1], torch.bfloat16)
    models = build_model(bridge, sys.argv[1], wrap_with_ddp=True)
    optimizer = build_optimizer(models, lr=1e-3, clip_grad=1.0, bf16=True)
    leaves = [leaf for leaf in _leaves(optimizer) if hasattr(leaf, "fp32_from_float16_groups")]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # main params off the bf16 grid, so the copy has to round
        for leaf in leaves:
            for group in leaf.fp32_from_float16_groups:
                for main in group:
                    main.add_(torch.randn(main.shape, generator=generator) * 1e-3)
    before = model_params(models)
    copied = {}
    for foreach in (True, False):
        use_foreach_param_copy(foreach)
        for param, value in zip(models[0].parameters(), before, strict=True):
            param.data.copy_(value)
        for leaf in leaves:
            leaf._copy_main_params_to_model_params()
        copied[foreach] = model_params(models)
    use_foreach_param_copy()
    print(json.dumps({
        "leaves": len(leaves), "main_params": sum(len(g) for leaf in leaves for g in leaf.fp32_from_float16_groups),
        "identical": all(torch.equal(a, b) for a, b in zip(copied[True], copied[False], strict=True)),
        "changed": sum(int(not torch.equal(a, b)) for a, b in zip(copied[True], before, strict=True))}), flush=True)


if __name__ == "__main__":
    main()
