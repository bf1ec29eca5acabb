"""Run in a subprocess by test_logits_dtype.py: a bf16 Megatron model scored from fp32-upcast logits (megatron's
Float16Module default, train.fp32_logits true) and from its bf16 logits (false) gives bit-identical log-probs,
entropies, losses and gradients.

    python logits_dtype_parity.py HF_DIR   -> one JSON line per case
"""

import json
import sys

import torch

from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.logprobs import compute_log_probs, forward_logits, pad_samples
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.types import Sample


def main_grads(models: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for p in models[0].parameters() if p.requires_grad]


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    bridge = make_bridge(hf_dir, torch.bfloat16)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    # lr 0: the weights never move, so every step below sees the same model
    optimizer = build_optimizer(models, lr=0.0, clip_grad=0.0, bf16=True, optimizer="sgd")
    vocab = bridge.hf_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, vocab, (p + r,), generator=generator).tolist(), response_length=r)
               for i, (p, r) in enumerate([(5, 9), (12, 3), (1, 14), (7, 4)])]
    batch = pad_samples(samples)
    with torch.no_grad():
        dtypes = {str(fp32): str(forward_logits(models[0], batch, fp32=fp32).dtype) for fp32 in (True, False)}
    scored = {fp32: compute_log_probs(models, samples, vocab_size=vocab, temperature=0.7, with_entropy=True,
                                      micro_batch_size=2, fp32_logits=fp32) for fp32 in (True, False)}
    pairs = zip(scored[True].log_probs + scored[True].entropies, scored[False].log_probs + scored[False].entropies,
                strict=True)
    print(json.dumps({"case": "compute_log_probs", "dtypes": dtypes, "identical": all(torch.equal(a, b) for a, b in pairs),
        "max_gap": max(float((a - b).abs().max()) for a, b in zip(scored[True].log_probs, scored[False].log_probs,
                                                                   strict=True))}), flush=True)
    arrays = TrainArrays(advantages=[1.0, -0.5, 0.25, -1.0], old_log_probs=[v - 0.01 for v in scored[True].log_probs])
    for case, settings in (("sft", dict(loss_type="sft_loss")),
                           ("policy with entropy", dict(loss_type="policy_loss", entropy_coef=0.01, temperature=0.7))):
        results = {}
        for fp32 in (True, False):
            step = StepSettings(micro_batch_size=2, fp32_logits=fp32, **settings)
            metrics = train_step(models, optimizer, samples, step, vocab_size=vocab,
                                 arrays=arrays if settings["loss_type"] == "policy_loss" else None)
            results[fp32] = metrics, main_grads(models)
        (m32, g32), (m16, g16) = results[True], results[False]
        print(json.dumps({"case": case, "loss_fp32": m32["loss"], "loss_bf16": m16["loss"],
                          "grad_norm": m32["grad_norm"], "grad_norm_bf16": m16["grad_norm"],
                          "grads_identical": all(torch.equal(a, b) for a, b in zip(g32, g16, strict=True)),
                          "grads_nonzero": sum(int(a.abs().sum() > 0) for a in g32), "params": len(g32)}), flush=True)


if __name__ == "__main__":
    main()
