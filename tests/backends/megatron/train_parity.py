"""Run in a subprocess by test_train.py: one Megatron train step vs the same step on the HF model.

    python train_parity.py HF_DIR   -> one JSON line per case

Each case builds a fresh Megatron model from HF_DIR, takes one SGD step with `train_step`, and compares
the exported weights with the same step written by hand on the HF model from `slime.algorithms`
functions. SGD makes the update lr x the clipped gradient, so the weights compare the gradients
themselves (Adam's first step, lr x g/|g|, would amplify fp32 rounding of tiny gradients).
"""

import json
import sys

import torch
from parity_samples import make_samples, padded
from transformers import AutoModelForCausalLM

from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.policy_loss import (
    cispo_loss,
    entropy_from_logits,
    gspo_policy_loss,
    policy_loss,
    tis_weights,
)
from slime.algorithms.reduce import sample_mean, token_mean
from slime.backends.megatron.bridge import export_hf_weights, init_megatron, make_bridge
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.types import Sample

LR = 0.5


def near(values: list[torch.Tensor], low: float, high: float, seed: int) -> list[torch.Tensor]:
    """`values` moved by uniform noise in [low, high): old/ref log-probs near the current policy's."""
    generator = torch.Generator().manual_seed(seed)
    return [v + low + (high - low) * torch.rand(v.shape, generator=generator) for v in values]


def hf_step(hf_dir: str, samples: list[Sample], s: StepSettings, arrays: TrainArrays) -> tuple[dict, float]:
    """The step by hand on the HF model: per-sample forward, slime.algorithms losses, SGD."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir).float()
    # HF freezes the pad token's input-embedding row (nn.Embedding padding_idx); Megatron trains it
    model.get_input_embeddings().padding_idx = None
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    width = max(x.response_length for x in samples)
    logp_rows, entropy_rows = [], []
    for x in samples:
        prompt, n = len(x.tokens) - x.response_length, x.response_length
        logits = model(torch.tensor([x.tokens])).logits[0].float()[prompt - 1 : -1] / s.temperature
        scores = torch.log_softmax(logits, -1).gather(1, torch.tensor(x.tokens[prompt:]).unsqueeze(1)).squeeze(1)
        logp_rows.append(torch.cat([scores, torch.zeros(width - n)]))
        entropy_rows.append(torch.cat([entropy_from_logits(logits), torch.zeros(width - n)]))
    logp, entropy = torch.stack(logp_rows), torch.stack(entropy_rows)
    mask = padded([x.loss_mask for x in samples], width).bool()
    if arrays.advantages is not None:
        adv = padded([a if not isinstance(a, float) else [a] * x.response_length
                      for a, x in zip(arrays.advantages, samples, strict=True)], width)
    else:
        adv = padded([[x.metadata["advantage"]] * x.response_length for x in samples], width)
    rollout = padded([x.rollout_log_probs for x in samples], width)
    train_old = padded(arrays.old_log_probs, width) if arrays.old_log_probs else logp.detach()
    old = rollout if s.use_rollout_logprobs else train_old

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return token_mean(x, mask) if s.calculate_per_token_loss else sample_mean(x, mask)

    if s.loss_type == "sft_loss":
        loss = reduce(-logp)
    else:
        clip = dict(eps_clip=s.eps_clip, eps_clip_high=s.eps_clip_high)
        if s.advantage_estimator == "cispo":
            pg = cispo_loss(logp, old, adv, mask, **clip).loss
        elif s.advantage_estimator == "gspo":
            pg = gspo_policy_loss(logp, old, adv, mask, eps_clip_c=s.eps_clip_c, **clip).loss
        else:
            pg = policy_loss(logp, old, adv, mask, eps_clip_c=s.eps_clip_c, **clip).loss
        if s.use_tis:
            pg = pg * tis_weights(train_old, rollout, s.tis_clip_low, s.tis_clip, mask)
        loss = reduce(pg) - s.entropy_coef * reduce(entropy)
        if s.use_kl_loss:
            ref = padded(arrays.ref_log_probs, width)
            loss = loss + s.kl_loss_coef * reduce(compute_approx_kl(logp, ref, s.kl_loss_type))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, float(loss.detach())


def build(hf_dir: str):
    bridge = make_bridge(hf_dir)
    models = bridge.get_model(wrap_with_ddp=True, bf16=False, use_cpu_initialization=True,
                              ddp_config={"grad_reduce_in_fp32": True, "use_distributed_optimizer": False})
    bridge.load_weights(models, hf_dir)
    return bridge, models


def cases(samples: list[Sample], logp: list[torch.Tensor]) -> dict[str, tuple[StepSettings, TrainArrays]]:
    policy = dict(loss_type="policy_loss", micro_batch_size=2)
    old = near(logp, -0.3, 0.3, seed=1)  # ratios 0.74 .. 1.35: the 0.2 clip binds on some tokens
    per_token_adv = [torch.linspace(-1.0, 1.5, x.response_length).tolist() for x in samples]
    return {
        "sft per-sample, 3 micro-batches": (StepSettings(loss_type="sft_loss", micro_batch_size=2), TrainArrays()),
        "sft per-token, 1 micro-batch": (StepSettings(loss_type="sft_loss", micro_batch_size=6,
                                                      calculate_per_token_loss=True), TrainArrays()),
        "policy rollout log-probs, 6 micro-batches": (
            StepSettings(loss_type="policy_loss", micro_batch_size=1, temperature=0.8, use_rollout_logprobs=True),
            TrainArrays()),
        "policy kl loss low_var_kl": (
            StepSettings(**policy, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="low_var_kl"),
            TrainArrays(old_log_probs=old, ref_log_probs=near(logp, -1.0, 1.0, seed=2))),
        "policy kl loss k2, per-token": (
            StepSettings(**policy, use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k2",
                         calculate_per_token_loss=True),
            TrainArrays(ref_log_probs=near(logp, -1.0, 1.0, seed=3))),
        "policy entropy": (StepSettings(**policy, entropy_coef=0.1), TrainArrays(old_log_probs=old)),
        "policy tis": (StepSettings(**policy, use_tis=True, tis_clip=1.2, tis_clip_low=0.8),
                       TrainArrays(old_log_probs=old)),
        "gspo": (StepSettings(**policy, advantage_estimator="gspo", eps_clip=0.05),
                 TrainArrays(old_log_probs=old)),
        "dual clip": (StepSettings(**policy, eps_clip_c=2.0),
                      TrainArrays(old_log_probs=near(logp, -1.2, 0.2, seed=4))),  # ratios 0.8 .. 3.3
        "cispo per-token advantages": (
            StepSettings(**policy, advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=0.1),
            TrainArrays(old_log_probs=old, advantages=per_token_adv)),
        "policy dynamic batch size": (
            StepSettings(**policy, use_dynamic_batch_size=True, max_tokens_per_gpu=24, entropy_coef=0.1),
            TrainArrays(old_log_probs=old)),
        "policy fixed micro-batches (dynamic's twin)": (StepSettings(**policy, entropy_coef=0.1),
                                                        TrainArrays(old_log_probs=old)),
    }


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    bridge, models = build(hf_dir)
    vocab = bridge.hf_config.vocab_size
    samples = make_samples(vocab)
    scored = compute_log_probs(models, samples, vocab_size=vocab, with_entropy=True, use_dynamic_batch_size=True,
                               max_tokens_per_gpu=30)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    gaps, entropy_gaps = [], []
    with torch.no_grad():
        for x, logp, entropy in zip(samples, scored.log_probs, scored.entropies, strict=True):
            prompt = len(x.tokens) - x.response_length
            expected = torch.log_softmax(hf(torch.tensor([x.tokens])).logits[0].float()[prompt - 1 : -1], -1)
            gaps.append((expected.gather(1, torch.tensor(x.tokens[prompt:]).unsqueeze(1)).squeeze(1) - logp)
                        .abs().max().item())
            entropy_gaps.append((entropy_from_logits(expected) - entropy).abs().max().item())
    for x, rollout in zip(samples, near(scored.log_probs, -0.3, 0.3, seed=5), strict=True):
        x.rollout_log_probs = rollout.tolist()  # the engine's log-probs: close to the trainer's
    print(json.dumps({"case": "compute_log_probs", "lengths": [len(v) for v in scored.log_probs],
                      "max_gap": max(gaps), "entropy_gap": max(entropy_gaps)}), flush=True)
    initial = hf.state_dict()
    previous: dict[str, torch.Tensor] = {}
    for case, (settings, arrays) in cases(samples, scored.log_probs).items():
        bridge, models = build(hf_dir)
        optimizer = build_optimizer(models, lr=LR, clip_grad=1.0, optimizer="sgd")
        metrics = train_step(models, optimizer, samples, settings, vocab_size=vocab, arrays=arrays)
        expected, hf_loss = hf_step(hf_dir, samples, settings, arrays)
        got = dict(export_hf_weights(bridge, models))
        row = {"case": case, "weight_gap": max((got[k] - expected[k]).abs().max().item() for k in got),
               "weights_moved": max((expected[k] - v).abs().max().item() for k, v in initial.items() if k in got),
               "hf_loss": hf_loss, "megatron_loss": metrics["loss"], "metrics": metrics}
        if "twin" in case:
            row["gap_to_dynamic"] = max((got[k] - previous[k]).abs().max().item() for k in got)
        previous = got
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
