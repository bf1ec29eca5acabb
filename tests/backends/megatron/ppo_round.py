"""Run in a subprocess by test_ppo_round.py: one PPO round on the tiny kit through the public API,
the way the RL loop drives the trainer (actor, frozen reference, critic; fp32 CPU).

    python ppo_round.py HF_DIR   -> one JSON line
"""

import json
import sys

import torch

from slime.algorithms.advantages import compute_advantages
from slime.algorithms.kl import compute_approx_kl
from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.critic import build_critic, compute_values
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays, split_rows, stack_rows
from slime.backends.megatron.train import StepSettings, train_step
from slime.backends.megatron.whiten import whiten_over_dp
from slime.types import Sample


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    bridge = make_bridge(hf_dir)
    vocab = bridge.hf_config.vocab_size
    actor = build_model(bridge, hf_dir, wrap_with_ddp=True)
    reference = build_model(bridge, hf_dir)
    critic = build_critic(bridge, hf_dir)
    generator = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, vocab, (5 + i + 4 + (i % 3),), generator=generator).tolist(),
                      response_length=4 + (i % 3), reward=float(i % 2)) for i in range(8)]
    dynamic = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=40)
    ref = compute_log_probs(reference, samples, vocab_size=vocab, **dynamic).log_probs
    old = compute_log_probs(actor, samples, vocab_size=vocab, micro_batch_size=3).log_probs
    values = compute_values(critic, samples, **dynamic)
    old_padded, mask = stack_rows(samples, old)
    kl = compute_approx_kl(old_padded, stack_rows(samples, ref)[0], "k1")
    rewards = torch.tensor([s.reward for s in samples])
    advantages, returns = compute_advantages("ppo", rewards, mask, kl=kl, values=stack_rows(samples, values)[0],
                                             kl_coef=0.01, gamma=1.0, lambd=0.95)
    arrays = TrainArrays(advantages=whiten_over_dp(samples, split_rows(advantages, samples)), old_log_probs=old,
                         ref_log_probs=ref)
    settings = StepSettings(loss_type="policy_loss", micro_batch_size=2, entropy_coef=0.01)
    optimizer = build_optimizer(actor, lr=1e-4, clip_grad=1.0)
    actor_steps = [train_step(actor, optimizer, samples, settings, vocab_size=vocab, arrays=arrays) for _ in range(2)]
    critic_optimizer = build_optimizer(critic, lr=1e-4, clip_grad=1.0)
    critic_arrays = TrainArrays(returns=split_rows(returns, samples), old_values=values)
    critic_steps = [train_step(critic, critic_optimizer, samples, StepSettings(loss_type="value_loss", **dynamic),
                               vocab_size=vocab, arrays=critic_arrays) for _ in range(3)]
    print(json.dumps({"actor": actor_steps, "critic": critic_steps,
                      "advantage_mean": float(torch.cat(arrays.advantages).mean())}), flush=True)


if __name__ == "__main__":
    main()
