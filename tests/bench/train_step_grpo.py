"""Run in a subprocess by test_train_step_bench.py: bench/train_step.py's GRPO pieces on the tiny model
(CPU, fp32): the reference model starts as the policy, the recomputed old and reference log-probs are the
model's own, and a policy step with the KL loss runs on them; then, at lr 0, a step as `--reuse-log-probs` times it
(no old-policy pass) against the recomputed one; last, `--against-reference`'s alternation of this project's step
with bench/torch_reference.py's on the same samples.

    python train_step_grpo.py HF_DIR   -> prints one JSON line
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import torch_reference  # noqa: E402
from train_step import against_reference, grpo_arrays, reference_model  # noqa: E402

from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge  # noqa: E402
from slime.backends.megatron.logprobs import pad_samples, response_log_probs  # noqa: E402
from slime.backends.megatron.optimizer import build_optimizer  # noqa: E402
from slime.backends.megatron.train import StepSettings, train_step  # noqa: E402
from slime.types import Sample  # noqa: E402


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    bridge = make_bridge(hf_dir)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    ref_models = reference_model(bridge, models)
    optimizer = build_optimizer(models, lr=1e-2, clip_grad=1.0)
    vocab = bridge.hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, vocab, (16,), generator=g).tolist(), response_length=12)
               for i in range(4)]
    settings = StepSettings(loss_type="policy_loss", micro_batch_size=2, use_kl_loss=True, kl_loss_coef=0.01,
                            kl_loss_type="low_var_kl", log_probs_chunk_size=5)
    rows = []
    for _ in range(2):
        arrays = grpo_arrays(models, ref_models, samples, [1.0, -1.0, 0.5, -0.5], settings, vocab)
        with torch.no_grad():
            direct, _, _ = response_log_probs(models[0], pad_samples(samples), vocab_size=vocab)
        old = torch.stack(arrays.old_log_probs)
        ref = torch.stack(arrays.ref_log_probs)
        metrics = train_step(models, optimizer, samples, settings, vocab_size=vocab, arrays=arrays)
        rows.append({"old_vs_direct": (old - direct).abs().max().item(), "old_vs_ref": (old - ref).abs().max().item(),
                     "kl_loss": metrics["kl_loss"], "grad_norm": metrics["grad_norm"]})
    # --log-probs-max-tokens: the forward-only passes packed by tokens give the same log-probs
    fixed = grpo_arrays(models, ref_models, samples, [1.0, -1.0, 0.5, -0.5], settings, vocab)
    packed = grpo_arrays(models, ref_models, samples, [1.0, -1.0, 0.5, -0.5], settings, vocab, 70)  # 4 per micro-batch, not 2
    packed_gap = max((torch.stack(getattr(packed, k)) - torch.stack(getattr(fixed, k))).abs().max().item()
                     for k in ("old_log_probs", "ref_log_probs"))
    ref_trainable = sum(p.requires_grad for m in ref_models for p in m.parameters())
    for group in optimizer.param_groups:  # both steps below start from the same weights
        group["lr"] = 0.0
    reuse = {}
    for flag in (False, True):
        step_settings = dataclasses.replace(settings, reuse_log_probs=flag)
        arrays = grpo_arrays(models, ref_models, samples, [1.0, -1.0, 0.5, -0.5], step_settings, vocab)
        metrics = train_step(models, optimizer, samples, step_settings, vocab_size=vocab, arrays=arrays)
        reuse[str(flag).lower()] = {"has_old": arrays.old_log_probs is not None, "loss": metrics["loss"],
                                    "grad_norm": metrics["grad_norm"], "pg_loss": metrics["pg_loss"]}
    print(json.dumps({"steps": rows, "ref_trainable": ref_trainable, "reuse": reuse, "packed_gap": packed_gap,
                      "against": against(bridge, models, optimizer, samples, vocab)}), flush=True)


def against(bridge, models, optimizer, samples, vocab) -> dict:
    """`--against-reference` on the tiny model: both arms step (each changes its own weights) and are timed."""
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    config = bridge.hf_config
    reference = torch_reference.build(config, torch.device("cpu"), False, dtype=torch.float32, fused=False)
    before = {"megatron": next(models[0].parameters()).detach().clone(),
              "reference": next(reference[0].parameters()).detach().clone()}
    args = argparse.Namespace(model="tiny", global_batch=len(samples), micro_batch=2, megatron=[], warmup=1, steps=2,
                              peak_tflops=989.0, reference_grad_checkpointing=False)
    shape = {"num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size}
    row = against_reference(models, optimizer, reference, samples, StepSettings(loss_type="sft_loss",
                            micro_batch_size=2), vocab, args, len(samples[0].tokens), 1000, shape)
    row["moved"] = {"megatron": (next(models[0].parameters()) - before["megatron"]).abs().max().item(),
                    "reference": (next(reference[0].parameters()) - before["reference"]).abs().max().item()}
    return row


if __name__ == "__main__":
    main()
