"""The `TrainInputs` part of the train actor (`slime/ray/train_actor.py`)."""

from __future__ import annotations

from typing import Any

from slime.backends.megatron.batching import forward_flops
from slime.errors import DataFormatError
from slime.plugins import load_plugin_field
from slime.ray.train_data import all_reduce_dp, apply_train_data, log_prob_stats
from slime.ray.train_weights import copy_weights, snapshot


class TrainInputs:
    """What one train call feeds the step: rewards and advantages, the old, reference and teacher log-probs of this
    rank's share, and the rollout metrics they give. Part of `TrainActor` (slime/ray/train_actor.py), whose
    state it uses."""

    def _train_inputs(self, samples: list[Any], uri: str) -> tuple[list[float], list[float]]:
        """(raw, trained) rewards of the batch: slime's --custom-convert-samples-to-train-data-path hook when set
        (`fn(args, samples) -> train_data`, slime's dict; what it returns replaces the samples' tokens, response
        lengths, loss masks and rollout log-probs where given, and its `rewards` are trained on as they are),
        else the group-normalised rewards."""
        path = self.config.reward.custom_convert_samples_to_train_data_path
        if not path:
            return self._rewards(samples, uri)

        convert = load_plugin_field(self.config.as_namespace(), "custom_convert_samples_to_train_data_path",
                                    ["args", "samples"], is_async=False)
        data = convert(self.config.as_namespace(), samples)
        return apply_train_data(samples, data, path)

    def _rewards(self, samples: list[Any], uri: str) -> tuple[list[float], list[float]]:
        """(raw, group-normalised) scalar rewards of the whole batch (every rank computes the same)."""
        import torch

        from slime.algorithms.rewards import custom_rewards, group_normalization_for, normalize_group_rewards

        c = self.config
        n = c.rollout.n_samples_per_prompt
        if len(samples) % n:
            raise DataFormatError(f"{uri}: {len(samples)} samples is not a whole number of groups of "
                                  f"n_samples_per_prompt={n}")
        for g in range(0, len(samples), n):
            if len({s.group_index for s in samples[g:g + n]}) != 1:
                raise DataFormatError(f"{uri}: samples {g}..{g + n - 1} are not one group (group_index differs); "
                                      "the rollout must store groups contiguously")
        args = c.as_namespace()
        if self.hooks is not None and self.hooks.reward_post_process is not None:  # slime: the plugin's rewards
            try:
                return custom_rewards(self.hooks.reward_post_process, args, samples,
                                      f"--custom-reward-post-process-path {c.reward.custom_reward_post_process_path}")
            except ValueError as exc:
                raise DataFormatError(f"{uri}: {exc}") from None
        raw = torch.tensor([float(s.get_reward_value(args)) for s in samples], dtype=torch.float32)
        how = group_normalization_for(c.algorithm.advantage_estimator, n,
                                      disable_rewards_normalization=c.algorithm.disable_rewards_normalization,
                                      disable_grpo_std_normalization=c.algorithm.disable_grpo_std_normalization)
        return raw.tolist(), normalize_group_rewards(raw, n, **how._asdict()).tolist()

    def _arrays(self, rollout_id: int, mine: list[Any], reuse: bool = False,
                values: list[Any] | None = None) -> tuple[Any, dict[str, float]]:
        """TrainArrays of this rank's samples (old/ref log-probs, advantages) and rollout-side metrics; with
        `reuse` (`can_reuse_log_probs`) no old log-probs, and the metrics that read them come from the step;
        `values`: the PPO critic's per-sample values, which the ppo estimator's GAE reads."""
        import torch

        from slime.algorithms.advantages import compute_advantages
        from slime.algorithms.kl import compute_approx_kl
        from slime.algorithms.opd import apply_opd_kl
        from slime.backends.megatron.logprobs import compute_log_probs
        from slime.backends.megatron.step_data import TrainArrays, split_rows, stack_rows
        from slime.backends.megatron.whiten import whiten_over_dp

        c, a, t = self.config, self.config.algorithm, self.config.train
        rollout_routing = self._rollout_routing(mine)
        if a.disable_compute_advantages_and_returns:  # slime: the samples carry their advantages
            return TrainArrays(routed_experts=rollout_routing), {}
        batching = dict(vocab_size=self.bridge.hf_config.vocab_size, temperature=c.rollout.rollout_temperature,
                        micro_batch_size=t.micro_batch_size, use_dynamic_batch_size=t.use_dynamic_batch_size,
                        max_tokens_per_gpu=t.log_probs_max_tokens_per_gpu or t.max_tokens_per_gpu,
                        pad_token_id=self.tokenizer.pad_token_id or 0, pad_multiple=t.data_pad_size_multiplier,
                        chunk_size=t.log_probs_chunk_size, compile_scores=t.compile_scores,
                        fp32_logits=t.fp32_logits, profile=lambda items: self.profiler.iterate("train_log_probs", items),
                        workload=self._flops if t.balance_by_flops else None)
        old = entropies = None
        if not reuse:
            if self.hooks.before_log_prob is not None:
                self.hooks.before_log_prob(c.as_namespace(), self.models, "")
            current = None
            if self.old_weights is not None:  # slime's --keep-old-actor: old log-probs under the rollout's weights
                current = snapshot(self.models)
                copy_weights(self.old_weights, self.models)
            # R3: the rollout's experts; R2 alone: this pass's experts, recorded for the train steps to replay
            actor = compute_log_probs(self.models, mine, with_entropy=a.use_rollout_entropy, **batching,
                                      routed_experts=rollout_routing,
                                      record_routing=a.use_routing_replay and rollout_routing is None)
            if current is not None:
                copy_weights(current, self.models)
            old, entropies = actor.log_probs, actor.entropies
            replayed = rollout_routing if rollout_routing is not None else actor.routed_experts
        else:  # no old-log-prob pass: R2 has nothing recorded (the step's forward is that pass), R3 still replays
            replayed = rollout_routing
        ref = None
        if self.ref_models:
            if self.hooks.before_log_prob is not None:
                self.hooks.before_log_prob(c.as_namespace(), self.ref_models, "ref_")
            ref = compute_log_probs(self.ref_models, mine, **batching).log_probs
        elif self.lora_kl:  # LoRA: the reference is the frozen base (+ starting adapters) of this model
            from slime.backends.megatron.lora import reference_adapters

            if self.hooks.before_log_prob is not None:
                self.hooks.before_log_prob(c.as_namespace(), self.models, "ref_")
            with reference_adapters(self.models, self.lora_reference):
                ref = compute_log_probs(self.models, mine, **batching).log_probs
        teacher = None
        if self.teacher_models:  # slime: the teacher's pass after the reference's, with the "teacher_" prefix
            if self.hooks.before_log_prob is not None:
                self.hooks.before_log_prob(c.as_namespace(), self.teacher_models, "teacher_")
            teacher = compute_log_probs(self.teacher_models, mine, **batching).log_probs
        _, mask = stack_rows(mine)
        # summed over ranks: |old - rollout| and its tokens, kl, log-probs, advantages, trained tokens, entropy,
        # teacher log-probs, OPD reverse KL
        sums = torch.zeros(9, dtype=torch.float64)
        sums[5] = float(mask.sum())
        if entropies is not None:  # --use-rollout-entropy
            sums[6] = float(stack_rows(mine, entropies)[0][mask].sum())
        kl = torch.zeros(mask.shape, dtype=torch.float32)  # with reuse, kl_coef is 0: advantages ignore it
        if old is not None:
            old_padded = stack_rows(mine, old)[0]
            if ref is not None:
                kl = compute_approx_kl(old_padded, stack_rows(mine, ref)[0], a.kl_loss_type)
                sums[2] = float(kl[mask].sum())
            sums[3] = float(old_padded[mask].sum())
            for sample, logp in zip(mine, old, strict=True):
                if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length:
                    m = torch.tensor(sample.loss_mask or [1] * sample.response_length, dtype=torch.bool)
                    diff = (logp - torch.tensor(sample.rollout_log_probs, dtype=torch.float32)).abs()
                    sums[0] += float(diff[m].sum())
                    sums[1] += float(m.sum())
        rewards = torch.tensor([s.metadata["normalized_reward"] for s in mine], dtype=torch.float32)
        hooks = self.hooks
        data = self._rollout_data(mine, old, ref, split_rows(kl, mine)) if hooks.advantage or \
            hooks.rollout_data_postprocess else {}
        if data and entropies is not None:
            data["entropy"] = entropies
        if data and values is not None:  # slime's rollout_data["values"]: the critic's, for the hooks
            data["values"] = values
        if data and teacher is not None:
            data["teacher_log_probs"] = teacher
        if hooks.advantage is not None:  # slime: replaces the estimator; sets advantages and returns
            hooks.advantage(c.as_namespace(), data)
            per_sample = [torch.as_tensor(v, dtype=torch.float32) for v in data["advantages"]]
        else:
            advantages, returns = compute_advantages(a.advantage_estimator, rewards, mask, kl=kl, kl_coef=a.kl_coef,
                                                     gamma=a.gamma, lambd=a.lambd,
                                                     values=None if values is None else stack_rows(mine, values)[0])
            per_sample = split_rows(advantages, mine)
            if data:
                data["returns"] = None if returns is None else split_rows(returns, mine)
        if teacher is not None:  # slime: after the estimator (or the advantage hook), before whitening
            per_sample, reverse_kl = apply_opd_kl(per_sample, self._student_log_probs(mine, old), teacher,
                                                  a.opd_kl_coef)
            sums[7] = float(stack_rows(mine, teacher)[0][mask].sum())
            sums[8] = float(stack_rows(mine, reverse_kl)[0][mask].sum())
            if data:
                data["opd_reverse_kl"] = reverse_kl
        if hooks.rollout_data_postprocess is not None:  # slime: may rewrite advantages and loss masks
            data["advantages"] = per_sample
            hooks.rollout_data_postprocess(c.as_namespace(), rollout_id, data)
            per_sample = [torch.as_tensor(v, dtype=torch.float32) for v in data["advantages"]]
            for sample, m in zip(mine, data["loss_masks"], strict=True):
                sample.loss_mask = [int(v) for v in torch.as_tensor(m).tolist()]
            _, mask = stack_rows(mine)
        if a.normalize_advantages:
            per_sample = whiten_over_dp(mine, per_sample)
        sums[4] = float(stack_rows(mine, per_sample)[0][mask].sum())
        all_reduce_dp(sums)
        sums = sums.tolist()
        stats = {} if old is None else log_prob_stats(  # reused: the step reports these (reused_log_prob_stats)
            sums[5], sums[3], sums[0], sums[1], kl=sums[2] if ref is not None else None,
            entropy=sums[6] if entropies is not None else None)
        stats["rollout/advantages"] = sums[4] / max(sums[5], 1.0)
        if teacher is not None:  # slime's names; train/ as its loss reports it (the same detached values)
            stats["rollout/teacher_log_probs"] = sums[7] / max(sums[5], 1.0)
            stats["rollout/opd_reverse_kl"] = stats["train/opd_reverse_kl"] = sums[8] / max(sums[5], 1.0)
        if c.run.log_correct_samples:
            stats.update(self._correct_sample_stats(mine, old))
        return TrainArrays(advantages=per_sample, old_log_probs=old, ref_log_probs=ref, routed_experts=replayed), stats

    def _rollout_routing(self, mine: list[Any]) -> list[Any] | None:
        """R3 (use_rollout_routing_replay): each sample's rollout_routed_experts, checked against the model (a
        sample without them is a DataFormatError naming it); None otherwise."""
        if not self.config.algorithm.use_rollout_routing_replay:
            return None
        from slime.backends.megatron import routing_replay

        return routing_replay.rollout_records(mine, routing_replay.require_routers(self.models))

    def _student_log_probs(self, mine: list[Any], old: list[Any]) -> list[Any]:
        """The student's log-probs OPD compares with the teacher's, as slime's: the engine's rollout log-probs with
        --use-rollout-logprobs, else the old log-probs just computed."""
        import torch

        if not self.config.algorithm.use_rollout_logprobs:
            return old
        for sample in mine:
            if sample.rollout_log_probs is None or len(sample.rollout_log_probs) != sample.response_length:
                raise DataFormatError(f"sample {sample.index}: --use-opd with --use-rollout-logprobs needs the "
                                      "engine's log-prob of every response token (rollout_log_probs)")
        return [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in mine]

    def _flops(self, length: int) -> float:
        """Estimated forward FLOPs of a sequence of `length` tokens under this model."""

        return forward_flops(length, self.bridge.hf_config)

    def _correct_sample_stats(self, mine: list[Any], old: list[Any]) -> dict[str, float]:
        """slime's --log-correct-samples over all ranks: of the responses with raw reward 1, the share in each
        quarter of rollout_max_response_len (correct_length/p25 ... p100) and their mean per-sample mean
        -log-prob of the response (correct_entropy, slime's name)."""
        import torch

        args = self.config.as_namespace()
        limit = self.config.rollout.rollout_max_response_len or max(s.response_length for s in mine)
        sums = torch.zeros(6, dtype=torch.float64)  # 4 quarters, correct samples, their mean -log-prob
        for sample, logp in zip(mine, old, strict=True):
            if float(sample.get_reward_value(args)) != 1:
                continue
            quarter = next(q for q in range(4) if sample.response_length <= limit * (q + 1) / 4 or q == 3)
            sums[quarter] += 1
            sums[4] += 1
            m = torch.tensor(sample.loss_mask or [1] * sample.response_length, dtype=torch.bool)
            sums[5] += float(-logp[m].sum()) / max(int(m.sum()), 1)
        all_reduce_dp(sums)
        total = float(sums[4]) + 1e-9
        out = {f"rollout/correct_length/p{25 * (q + 1)}": float(sums[q]) / total for q in range(4)}
        out["rollout/correct_entropy"] = float(sums[5]) / total if sums[4] else 0.0
        return out

    def _rollout_data(self, mine: list[Any], old: list[Any], ref: list[Any] | None, kl: list[Any]) -> dict[str, Any]:
        """This rank's samples as slime's `rollout_data` lists (what its advantage/post-process hooks get)."""
        import torch

        return {
            "rewards": [s.metadata["normalized_reward"] for s in mine],
            "raw_reward": [float(s.get_reward_value(self.config.as_namespace())) for s in mine],
            "log_probs": old, "ref_log_probs": ref, "kl": kl,
            "rollout_log_probs": [None if s.rollout_log_probs is None else
                                  torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in mine],
            "loss_masks": [torch.tensor(s.loss_mask or [1] * s.response_length, dtype=torch.int32) for s in mine],
            "response_lengths": [s.response_length for s in mine],
            "total_lengths": [len(s.tokens) for s in mine],
            "tokens": [torch.tensor(s.tokens) for s in mine],
        }
