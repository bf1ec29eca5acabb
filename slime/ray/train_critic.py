"""The `Critic` part of the train actor (`slime/ray/train_actor.py`): PPO's value model on the actor's ranks.

slime runs the critic as a second RayTrainGroup on the actor's placement group, with the actor's GPU count and
Megatron arguments (`slime/ray/placement_group.py`; `--critic-num-nodes/--critic-num-gpus-per-node` are set
from the actor's, it has no flag of its own for them nor a critic learning rate). Here the critic is a second
model on the same ranks and the same parallel layout (`critic.build_critic`: the policy's transformer from the
HF checkpoint, a 1-output value head drawn from `run.seed`), with its own optimizer and LR schedule built from
the same `train:` settings, so data parallelism is the actor's: each rank trains the critic on its own share.

Per rollout, before the actor's passes (`critic_step`):

1. V(s_t) of every response token of this rank's samples (`compute_values`, forward only);
2. the value targets: GAE returns over those values with no KL penalty (slime's critic role sets kl_coef 0, so
   its `compute_advantages_and_returns` sees kl = 0), `algorithm.gamma` / `algorithm.lambd`;
3. one value-loss optimizer step per actor step, on the actor's step split (slime's critic trains on the same
   global batch sizes), clipped by `algorithm.value_clip` around the values of step 1 (slime's old values).

The values of step 1, taken before the critic's update, are the ones the actor's GAE advantages read, as slime's
critic hands its pre-update values to the actor (`external_data`). Departure: slime's critic also starts from
`--load` (its head re-initialised); here, unless resuming a checkpoint that holds a critic, it starts from the HF
checkpoint.

Checkpoints: the critic's (weights, optimizer, schedule) go to `{save}/critic/iter_N`, saved and committed before
the actor's `{save}/iter_N`, so a committed actor checkpoint always has its critic; a resume loads it beside the
actor's (its RNG is the actor's, restored once).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from slime.ray.train_data import mean_metrics, slice_arrays, total_train_steps
from slime.storage.fs import join_uri

logger = logging.getLogger(__name__)

CRITIC_DIR = "critic"  # the critic's checkpoint root under the actor's (`{save}/critic/iter_N`)


def critic_checkpoint(actor_checkpoint: str) -> str:
    """`{root}/critic/iter_N` of the actor's `{root}/iter_N`."""
    root, name = os.path.split(actor_checkpoint.rstrip("/"))
    return os.path.join(root, CRITIC_DIR, name)


class Critic:
    """Building, training, saving and loading the PPO critic. Part of `TrainActor` (slime/ray/train_actor.py),
    whose state it uses; `critic_models` stays None unless the estimator is ppo."""

    def _build_critic(self) -> None:
        """The critic's model, optimizer and schedule. Built before the actor's weights load: building draws from
        the process's random state, which a resume restores afterwards (uninterrupted and resumed runs agree)."""
        from slime.backends.megatron.critic import build_critic
        from slime.backends.megatron.optimizer import build_config_optimizer, build_scheduler

        c = self.config
        self.critic_models = build_critic(self.bridge, c.checkpoint.hf_checkpoint, seed=c.run.seed)
        self.critic_optimizer = build_config_optimizer(self.critic_models, c, use_distributed_optimizer=False)
        self.critic_scheduler = build_scheduler(self.critic_optimizer, c.train, total_train_steps(c))

    def _load_critic(self, resumed: str | None, partial: dict[str, bool]) -> None:
        """On a resume from the actor checkpoint `resumed`: the critic saved beside it, with the actor's
        --no-load-optim (`partial`); its RNG is not loaded (the actor's is, once). A checkpoint without a critic
        (a GRPO run's, a Megatron-LM one) leaves the fresh critic, logged."""
        from slime.backends.megatron.checkpoint import load_checkpoint
        from slime.storage import is_committed

        if resumed is None:
            return
        path = critic_checkpoint(resumed)
        if not is_committed(path):
            logger.warning("rank %d: %s holds no critic (%s): the PPO critic starts fresh from the HF checkpoint",
                           self.rank, resumed, path)
            return
        load_checkpoint(self.critic_models, path, self.critic_optimizer, self.critic_scheduler,
                        load_optim=partial.get("load_optim", True), load_rng=False)
        logger.info("rank %d: critic resumed from %s", self.rank, path)

    def critic_step(self, rollout_id: int, shares: list[list[Any]], settings: Any) -> tuple[list[Any], dict[str, float]]:
        """Values of this rank's samples (`shares` concatenated, before the update) and the metrics of the critic's
        value-loss steps, one per share: slime's `train/critic-*` names, plus `train/value_loss` and
        `train/value_clipfrac`. `settings`: the actor's StepSettings, whose batching the critic shares."""
        import torch

        from slime.algorithms.advantages import compute_advantages
        from slime.backends.megatron.critic import compute_values
        from slime.backends.megatron.optimizer import reset_optimizer_states
        from slime.backends.megatron.step_data import TrainArrays, split_rows, stack_rows
        from slime.backends.megatron.train import train_step

        t, a = self.config.train, self.config.algorithm
        mine = [s for share in shares for s in share]
        pad = self.tokenizer.pad_token_id or 0
        values = compute_values(self.critic_models, mine, micro_batch_size=t.micro_batch_size,
                                use_dynamic_batch_size=t.use_dynamic_batch_size,
                                max_tokens_per_gpu=t.log_probs_max_tokens_per_gpu or t.max_tokens_per_gpu,
                                pad_token_id=pad)
        padded, mask = stack_rows(mine, values)
        rewards = torch.tensor([s.metadata["normalized_reward"] for s in mine], dtype=torch.float32)
        returns = compute_advantages("ppo", rewards, mask, kl=torch.zeros(mask.shape), values=padded,
                                     gamma=a.gamma, lambd=a.lambd).returns
        arrays = TrainArrays(returns=split_rows(returns, mine), old_values=values)
        critic_settings = replace(settings, loss_type="value_loss", reuse_log_probs=False)
        rows, start = [], 0
        for share in shares:
            part = slice_arrays(arrays, start, start + len(share))
            start += len(share)
            if t.use_stateless_adam:  # the actor's optimizer settings are the critic's (slime: one set of args)
                reset_optimizer_states(self.critic_optimizer)
            rows.append(train_step(self.critic_models, self.critic_optimizer, share, critic_settings,
                                   vocab_size=self.bridge.hf_config.vocab_size, pad_token_id=pad, arrays=part))
            self.critic_scheduler.step(1)
        if t.reset_optimizer_states:
            reset_optimizer_states(self.critic_optimizer)
        mean = mean_metrics(rows)
        metrics = {f"train/critic-{k}": v for k, v in mean.items()}
        metrics.update({f"train/{k}": mean[k] for k in ("value_loss", "value_clipfrac")})
        logger.info("rank %d rollout %d: critic %d steps, value_loss %.4f, grad_norm %.4f", self.rank, rollout_id,
                    len(rows), mean["value_loss"], mean["grad_norm"])
        return values, metrics

    def _save_critic(self, rollout_id: int, full: bool, remote: str | None, metadata: dict[str, Any]) -> None:
        """The critic's checkpoint `{save}/critic/iter_N`, committed before the actor's (see the module docstring)."""
        from slime.backends.megatron.checkpoint import save_checkpoint

        ck = self.config.checkpoint
        save_checkpoint(self.critic_models, os.path.join(ck.save, CRITIC_DIR), rollout_id,
                        optimizer=self.critic_optimizer if full else None,
                        scheduler=self.critic_scheduler if full else None,
                        metadata={**metadata, "role": "critic"},
                        config_hash=self.config.section_hash("train", "algorithm", "checkpoint", "megatron"),
                        fully_reshardable=ck.dist_ckpt_optim_fully_reshardable,
                        remote=join_uri(remote, CRITIC_DIR) if remote else None,
                        storage_options=self.config.run.storage_options, keep=ck.keep_checkpoints,
                        saver=self.saver)
