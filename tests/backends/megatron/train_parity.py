"""Run in a subprocess by test_train.py: one Megatron train step vs the same step on the HF model.

Prints one JSON line per case: the largest weight difference after the step, the step loss of both.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from slime.algorithms.policy_loss import policy_loss
from slime.algorithms.reduce import sample_mean, token_mean
from slime.backends.megatron.bridge import export_hf_weights, init_megatron, make_bridge
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.train import StepSettings, train_step
from slime.types import Sample


def make_samples(vocab: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i, (prompt_len, response_len) in enumerate([(4, 6), (9, 2), (3, 8), (6, 5), (2, 3), (7, 7)]):
        tokens = torch.randint(0, vocab, (prompt_len + response_len,), generator=generator).tolist()
        mask = [1] * response_len
        mask[0] = 0  # e.g. a tool token: not trained
        samples.append(Sample(index=i, tokens=tokens, response_length=response_len, loss_mask=mask,
                              rollout_log_probs=(-torch.rand(response_len, generator=generator)).tolist(),
                              metadata={"advantage": float(i % 3) - 1.0}))
    return samples


def hf_step(hf_dir: str, samples: list[Sample], settings: StepSettings, lr: float) -> tuple[dict, float]:
    model = AutoModelForCausalLM.from_pretrained(hf_dir).float()
    # HF freezes the pad token's input-embedding row (nn.Embedding padding_idx); Megatron trains it
    model.get_input_embeddings().padding_idx = None
    model.train()
    # SGD: the update is lr x the clipped gradient, so the weights compare the gradients themselves
    # (Adam's first step, lr x g/|g|, would amplify fp32 rounding of tiny gradients)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    width = max(s.response_length for s in samples)
    logp = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    old = torch.zeros(len(samples), width)
    adv = torch.zeros(len(samples), width)
    rows = []
    for row, s in enumerate(samples):
        prompt, n = len(s.tokens) - s.response_length, s.response_length
        logits = model(torch.tensor([s.tokens])).logits[0].float() / settings.temperature
        scores = torch.log_softmax(logits[prompt - 1 : -1], -1).gather(1, torch.tensor(s.tokens[prompt:]).unsqueeze(1))
        rows.append(torch.cat([scores.squeeze(1), torch.zeros(width - n)]))
        mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        old[row, :n] = torch.tensor(s.rollout_log_probs)
        adv[row, :n] = s.metadata["advantage"]
    logp = torch.stack(rows)
    if settings.loss_type == "sft_loss":
        per_token = -logp
    else:
        per_token = policy_loss(logp, old, adv, mask, eps_clip=settings.eps_clip).loss
    loss = token_mean(per_token, mask) if settings.calculate_per_token_loss else sample_mean(per_token, mask)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, float(loss)


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    lr = 0.5
    for case, settings in {
        "sft per-sample, 3 micro-batches": StepSettings(loss_type="sft_loss", micro_batch_size=2),
        "sft per-token, 1 micro-batch": StepSettings(loss_type="sft_loss", micro_batch_size=6,
                                                     calculate_per_token_loss=True),
        "policy per-sample, 6 micro-batches": StepSettings(loss_type="policy_loss", micro_batch_size=1,
                                                           temperature=0.8),
    }.items():
        bridge = make_bridge(hf_dir)
        models = bridge.get_model(wrap_with_ddp=True, bf16=False, use_cpu_initialization=True,
                                  ddp_config={"grad_reduce_in_fp32": True, "use_distributed_optimizer": False})
        bridge.load_weights(models, hf_dir)
        optimizer = build_optimizer(models, lr=lr, clip_grad=1.0, optimizer="sgd")
        samples = make_samples(bridge.hf_config.vocab_size)
        metrics = train_step(models, optimizer, samples, settings, vocab_size=bridge.hf_config.vocab_size)
        expected, hf_loss = hf_step(hf_dir, samples, settings, lr)
        got = dict(export_hf_weights(bridge, models))
        gap = max((got[k] - expected[k]).abs().max().item() for k in got)
        moved = max((expected[k] - v).abs().max().item()
                    for k, v in AutoModelForCausalLM.from_pretrained(hf_dir).state_dict().items() if k in got)
        loss_name = "sft_loss" if settings.loss_type == "sft_loss" else None
        print(json.dumps({"case": case, "weight_gap": gap, "weights_moved": moved, "hf_loss": hf_loss,
                          "megatron_loss": metrics.get(loss_name) if loss_name else None,
                          "grad_norm": metrics["grad_norm"]}), flush=True)


if __name__ == "__main__":
    main()
