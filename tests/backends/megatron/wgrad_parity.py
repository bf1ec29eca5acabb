"""Run in a subprocess by test_wgrad_fusion.py (CPU) and test_wgrad_fusion_gpu.py (CUDA, bf16): megatron's
gradient-accumulation fusion through torch's provider (slime/backends/megatron/wgrad_fusion.py) against the
unfused path, on DDP-wrapped models built from one checkpoint.

    python wgrad_parity.py HF_DIR [bf16]   -> one JSON line

Two micro-batches forward and backward into each model's DDP gradient buffers (the second adds onto the
first's `main_grad`); the line holds the largest gap of the `main_grad`s of the trainable weights, their
scale, how often the provider ran, the flags the models' configs got, and whether a model built without DDP
(no `main_grad`) still runs its backward with the fusion option on.
"""

import json
import sys

import torch

from slime.backends.megatron import wgrad_fusion
from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge


def main_grads(hf_dir: str, dtype: torch.dtype, megatron: dict) -> tuple[dict[str, torch.Tensor], bool, int]:
    bridge = make_bridge(hf_dir, dtype, megatron=megatron)
    model = build_model(bridge, hf_dir, wrap_with_ddp=True)[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed in (0, 1):  # two micro-batches: the second accumulates onto the first
        tokens = torch.randint(0, bridge.hf_config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))
        tokens = tokens.to(device)
        positions = torch.arange(24, device=device).unsqueeze(0).expand_as(tokens)
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)
        logits.float().pow(2).mean().backward()
    grads = {name: p.main_grad.detach().clone() for name, p in model.module.named_parameters()}
    fused_layers = sum(bool(getattr(m, "gradient_accumulation_fusion", False)) for m in model.modules())
    return grads, bool(model.config.gradient_accumulation_fusion), fused_layers


def main() -> None:
    hf_dir = sys.argv[1]
    dtype = torch.bfloat16 if sys.argv[2:] == ["bf16"] else torch.float32
    init_megatron(seed=0)
    calls = []
    for name in ("wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"):
        real = getattr(wgrad_fusion.PROVIDER, name)
        setattr(wgrad_fusion.PROVIDER, name, lambda *a, real=real: calls.append(1) or real(*a))
    default_flag = bool(make_bridge(hf_dir, dtype).config.gradient_accumulation_fusion)
    plain, plain_flag, _ = main_grads(hf_dir, dtype, {"gradient_accumulation_fusion": False})
    plain_calls = len(calls)
    fused, fused_flag, fused_layers = main_grads(hf_dir, dtype, {"gradient_accumulation_fusion": True})
    assert plain.keys() == fused.keys()
    gaps = {name: (plain[name] - fused[name]).abs().max().item() for name in plain}
    scales = {name: plain[name].abs().max().item() for name in plain}
    worst = max(gaps, key=lambda name: gaps[name] / max(scales[name], 1e-30))
    # without DDP there is no main_grad: build_model leaves such a model's weight gradients unfused
    bare = build_model(make_bridge(hf_dir, dtype, megatron={"gradient_accumulation_fusion": True}), hf_dir)[0]
    device = next(bare.parameters()).device
    tokens = torch.randint(0, 50, (1, 8), device=device)
    bare(input_ids=tokens, position_ids=torch.arange(8, device=device).unsqueeze(0), attention_mask=None).sum().backward()
    print(json.dumps({"dtype": str(dtype), "grad_gap": gaps[worst], "grad_scale": scales[worst], "worst": worst,
                      "max_gap": max(gaps.values()), "max_scale": max(scales.values()), "weights": len(plain),
                      "plain_calls": plain_calls, "fused_calls": len(calls) - plain_calls, "fused_layers": fused_layers,
                      "plain_flag": plain_flag, "fused_flag": fused_flag, "default_flag": default_flag,
                      "bare_grads": sum(p.grad is not None for p in bare.parameters()),
                      "available": wgrad_fusion.available()}), flush=True)


if __name__ == "__main__":
    main()
