"""Run in a subprocess by test_rl_step_gpu.py: the train step on CUDA in bf16 for a random
Qwen2.5-0.5B-shaped model: compute_log_probs vs HF, policy steps (KL, entropy, TIS, dynamic batching),
critic value steps. Prints one JSON line per part.

    python rl_step_gpu.py WORK_DIR
"""

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.critic import build_critic, compute_values
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.data.random_models import save_random_qwen2
from slime.types import Sample


def make_samples(vocab: int, n: int = 16) -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        prompt = int(torch.randint(32, 256, (1,), generator=generator))
        response = int(torch.randint(64, 768, (1,), generator=generator))
        tokens = torch.randint(0, vocab, (prompt + response,), generator=generator).tolist()
        samples.append(Sample(index=i, tokens=tokens, response_length=response, loss_mask=[1] * response,
                              metadata={"advantage": float(i % 4) - 1.5}))
    return samples


def jitter(v: torch.Tensor, amount: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return v + amount * (2 * torch.rand(v.shape, generator=generator) - 1)


def main() -> None:
    work = Path(sys.argv[1])
    hf_dir = work / "hf"
    save_random_qwen2(hf_dir, "0.5b")
    init_megatron(seed=0)
    bridge = make_bridge(str(hf_dir), torch.bfloat16)
    vocab = bridge.hf_config.vocab_size
    models = build_model(bridge, str(hf_dir), wrap_with_ddp=True)
    samples = make_samples(vocab)
    tokens = sum(len(s.tokens) for s in samples)

    torch.cuda.synchronize()
    start = time.perf_counter()
    scored = compute_log_probs(models, samples, vocab_size=vocab, with_entropy=True, use_dynamic_batch_size=True,
                               max_tokens_per_gpu=4096)
    torch.cuda.synchronize()
    logprob_time = time.perf_counter() - start
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).cuda().eval()
    gaps = []
    with torch.no_grad():
        for x, logp in zip(samples[:4], scored.log_probs, strict=False):
            prompt = len(x.tokens) - x.response_length
            logits = hf(torch.tensor([x.tokens], device="cuda")).logits[0].float()[prompt - 1 : -1]
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(x.tokens[prompt:], device="cuda")[:, None])
            gaps.append((expected[:, 0].cpu() - logp).abs())
    del hf
    gaps = torch.cat(gaps)
    print(json.dumps({"case": "compute_log_probs", "tokens": tokens, "seconds": logprob_time,
                      "mean_gap": float(gaps.mean()), "max_gap": float(gaps.max()),
                      "mean_logp": float(torch.cat(scored.log_probs).mean()),
                      "mean_entropy": float(torch.cat(scored.entropies).mean())}), flush=True)

    for x, v in zip(samples, scored.log_probs, strict=True):
        x.rollout_log_probs = jitter(v, 0.05, seed=x.index).tolist()
    optimizer = build_optimizer(models, lr=1e-5, clip_grad=1.0, bf16=True)
    settings = StepSettings(loss_type="policy_loss", use_dynamic_batch_size=True, max_tokens_per_gpu=4096,
                            use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type="low_var_kl", entropy_coef=0.001,
                            use_tis=True)
    ref = TrainArrays(ref_log_probs=scored.log_probs)
    steps = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = train_step(models, optimizer, samples, settings, vocab_size=vocab, arrays=ref)
        torch.cuda.synchronize()
        steps.append({**metrics, "seconds": time.perf_counter() - start})
    print(json.dumps({"case": "policy steps", "tokens": tokens, "steps": steps,
                      "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)

    del models, optimizer
    critic = build_critic(bridge, str(hf_dir))
    values = compute_values(critic, samples, use_dynamic_batch_size=True, max_tokens_per_gpu=4096)
    optimizer = build_optimizer(critic, lr=1e-5, clip_grad=1.0, bf16=True)
    arrays = TrainArrays(returns=[torch.ones_like(v) for v in values], old_values=values)
    value_settings = StepSettings(loss_type="value_loss", use_dynamic_batch_size=True, max_tokens_per_gpu=4096,
                                  value_clip=10.0)
    losses = [train_step(critic, optimizer, samples, value_settings, vocab_size=vocab, arrays=arrays)["value_loss"]
              for _ in range(6)]
    print(json.dumps({"case": "value steps", "losses": losses, "values_finite": all(bool(torch.isfinite(v).all())
                                                                                   for v in values)}), flush=True)


if __name__ == "__main__":
    main()
