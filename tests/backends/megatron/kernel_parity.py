"""Run in a subprocess by test_train_kernels.py: three Adam train steps of the tiny model (fp32, CPU) with the
issue-17 kernels on (fused AdamW, gradient-accumulation fusion, rotary fusion, compiled scoring: what CUDA gets
by default)
against the same steps with all three off, through `train_step` (micro-batches, DDP buffers, clipping).

    python kernel_parity.py HF_DIR   -> one JSON line {weight_gap, moved, losses, flags, calls}
"""

import json
import sys

import torch

from slime.backends.megatron import rope_fusion, score_kernels, wgrad_fusion
from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.optimizer import build_optimizer, torch_optimizers
from slime.backends.megatron.train import StepSettings, train_step
from slime.types import Sample


def run(hf_dir: str, on: bool) -> tuple[dict[str, torch.Tensor], list[float], dict[str, bool]]:
    bridge = make_bridge(hf_dir, megatron={"gradient_accumulation_fusion": on, "apply_rope_fusion": on})
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    # adam_eps 1e-3: with 1e-8, weights whose gradients are ~1e-9 (rounding-level) get lr-sized updates of any sign
    optimizer = build_optimizer(models, lr=1e-2, clip_grad=1.0, weight_decay=0.01, adam_eps=1e-3, fused_adam=on)
    vocab = bridge.hf_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, vocab, (10 + i,), generator=generator).tolist(),
                      response_length=6, loss_mask=[1] * 6) for i in range(4)]
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=2, compile_scores=on)
    losses = [train_step(models, optimizer, samples, settings, vocab_size=vocab)["sft_loss"] for _ in range(3)]
    weights = {n: p.detach().clone() for n, p in models[0].module.named_parameters()}
    flags = {"grad_accum_fusion": bool(bridge.config.gradient_accumulation_fusion),
             "rope_fusion": bool(bridge.config.apply_rope_fusion),
             "fused_adam": all(g["fused"] for o in torch_optimizers(optimizer) for g in o.param_groups),
             "compiled_scores": bool(settings.compile_scores)}
    return weights, losses, flags


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    calls = {"wgrad": 0, "rope": 0, "scores": 0}
    real_wgrad, real_rope, real_kernels = (wgrad_fusion.PROVIDER.wgrad_gemm_accum_fp32, rope_fusion._compiled,
                                           score_kernels.kernels)

    def count_scores(compiled: bool):
        calls["scores"] += compiled  # chunk kernels asked for compiled (forward, then backward, per micro-batch)
        return real_kernels(compiled)

    def count_wgrad(*a):
        calls["wgrad"] += 1
        return real_wgrad(*a)

    def count_rope(*a):
        calls["rope"] += 1
        return real_rope(*a)

    wgrad_fusion.PROVIDER.wgrad_gemm_accum_fp32, rope_fusion._compiled = count_wgrad, count_rope
    score_kernels.kernels = count_scores
    start = {n: p.detach().clone() for n, p in build_model(make_bridge(hf_dir), hf_dir)[0].named_parameters()}
    off, off_losses, off_flags = run(hf_dir, False)
    off_calls = dict(calls)
    on, on_losses, on_flags = run(hf_dir, True)
    gaps = {n: (on[n] - off[n]).abs().max().item() for n in off}
    print(json.dumps({"weight_gap": max(gaps.values()), "worst": max(gaps, key=gaps.get),
                      "moved": min((off[n] - start[n]).abs().max().item() for n in off),
                      "off_losses": off_losses, "on_losses": on_losses, "off_flags": off_flags, "on_flags": on_flags,
                      "off_calls": off_calls, "on_calls": {k: calls[k] - off_calls[k] for k in calls}}), flush=True)


if __name__ == "__main__":
    main()
