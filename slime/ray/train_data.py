"""How a train call shapes its rollout: steps per rollout, each rank's share, subsampling, train data from plugins,
log-prob statistics."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from slime.backends.megatron.batching import balanced_partition
from slime.config import Config
from slime.errors import ConfigError, DataFormatError

STAGE = "rl"  # what the train actor's checkpoints record as their stage


def steps_per_rollout(config: Config, num_samples: int) -> int:
    """Optimizer steps a rollout of `num_samples` samples is cut into."""
    t = config.train
    if t.num_steps_per_rollout:
        return t.num_steps_per_rollout
    if t.global_batch_size:
        if num_samples < t.global_batch_size:
            raise DataFormatError(f"the rollout has {num_samples} samples, fewer than global_batch_size "
                                  f"{t.global_batch_size}")
        return num_samples // t.global_batch_size
    return 1


def total_train_steps(config: Config) -> int | None:
    """Optimizer steps of the whole run (the LR schedule's length), when num_rollout is known."""
    r = config.rollout
    if not r.num_rollout or not r.rollout_batch_size:
        return None
    return r.num_rollout * steps_per_rollout(config, r.rollout_batch_size * r.n_samples_per_prompt)


def can_reuse_log_probs(config: Config, steps: int, hooks: Any) -> bool:
    """Whether the old-log-prob pass can be skipped: slime's can_reuse_log_probs_in_loss (one optimizer step per
    rollout, so the old policy is the one the loss runs; policy loss; no kl_coef, rollout log-probs as old,
    mismatch metrics, critic, old actor, OPD or GSPO), plus what reads old log-probs before the step here: the
    advantage and rollout-data-postprocess hooks and --log-correct-samples (per-sample log-probs)."""
    a = config.algorithm
    return (steps == 1 and a.loss_type == "policy_loss" and a.kl_coef == 0 and not a.use_rollout_logprobs
            and not a.get_mismatch_metrics and not a.keep_old_actor and a.advantage_estimator not in ("gspo", "ppo")
            and not a.use_opd and not config.run.log_correct_samples and hooks.advantage is None
            and hooks.rollout_data_postprocess is None)


def log_prob_stats(tokens: float, log_probs: float, abs_diff: float, abs_diff_tokens: float,
                   kl: float | None = None, entropy: float | None = None) -> dict[str, float]:
    """The rollout metrics read off the old log-probs, from their sums over the trained tokens of all ranks:
    mean log-prob, mean |old - rollout| (over the samples with rollout log-probs), KL to the reference and
    entropy (each where given). One formula for the recomputed pass (`_arrays`) and the reused one."""
    tokens = max(tokens, 1.0)
    stats = {"rollout/log_probs": log_probs / tokens}
    if abs_diff_tokens > 0:
        stats["train/train_rollout_logprob_abs_diff"] = abs_diff / abs_diff_tokens
    if kl is not None:
        stats["rollout/kl"] = kl / tokens
    if entropy is not None:
        stats["rollout/entropy"] = entropy / tokens
    return stats


def reused_log_prob_stats(row: dict[str, float], with_kl: bool, with_entropy: bool) -> dict[str, float]:
    """The rollout metrics of the skipped old-log-prob pass (`log_prob_stats`), from the REUSED_PREFIX sums a
    `reuse_log_probs` step reports; pops those sums from `row`."""
    from slime.backends.megatron.train import REUSED_PREFIX

    sums = {k[len(REUSED_PREFIX):]: row.pop(k) for k in list(row) if k.startswith(REUSED_PREFIX)}
    return log_prob_stats(sums["tokens"], sums["log_probs"], sums["abs_diff"], sums["abs_diff_tokens"],
                          kl=sums["kl"] if with_kl else None, entropy=sums["entropy"] if with_entropy else None)


def rank_share(samples: list[Any], steps: int, rank: int, world_size: int,
               workloads: list[float] | None = None) -> list[list[Any]]:
    """This rank's samples of each step: step k is `samples[k*G:(k+1)*G]`, rank r takes every
    world_size-th sample of it starting at r; with `workloads` (slime's --balance-data: one estimated cost
    per sample) rank r takes group r of the step's Karmarkar-Karp partition into equal-count groups."""

    size = len(samples) // steps
    if size % world_size:
        raise ConfigError(f"{size} samples per optimizer step cannot be split over {world_size} data-parallel "
                          "ranks; make global_batch_size (or the rollout size / num_steps_per_rollout) a multiple "
                          "of the number of data-parallel ranks (train actors / (TP x PP))")
    if workloads is None:
        return [samples[k * size:(k + 1) * size][rank::world_size] for k in range(steps)]
    return [[samples[k * size + i] for i in balanced_partition(workloads[k * size:(k + 1) * size], world_size)[rank]]
            for k in range(steps)]


def subsample_rollout(samples: list[Any], ratio: float, group_size: int) -> list[Any]:
    """slime's --load-debug-rollout-data-subsample: about `ratio` of the rows, the first half and the last
    half of them; here in whole groups of `group_size`, which group reward normalisation needs."""
    groups = len(samples) // group_size
    keep = int(groups * ratio)
    if keep == 0:
        raise DataFormatError(f"load_debug_rollout_data_subsample {ratio} keeps no group of the {groups} stored")
    head, tail = keep // 2, keep - keep // 2
    return samples[:head * group_size] + samples[len(samples) - tail * group_size:]


def apply_train_data(samples: list[Any], data: Any, source: str) -> tuple[list[float], list[float]]:
    """Write slime's `train_data` dict (what its samples-to-train-data conversion returns) back onto the samples
    the trainer reads; (raw rewards, rewards). `rewards` is required; `raw_reward` defaults to it."""
    if not isinstance(data, dict) or "rewards" not in data:
        raise DataFormatError(f"custom_convert_samples_to_train_data_path {source}: must return slime's train_data "
                              f"dict with at least 'rewards', got {type(data).__name__}"
                              f"{' with keys ' + str(sorted(data)) if isinstance(data, dict) else ''}")
    for key in ("rewards", "raw_reward", "tokens", "response_lengths", "loss_masks", "rollout_log_probs"):
        if key in data and len(data[key]) != len(samples):
            raise DataFormatError(f"custom_convert_samples_to_train_data_path {source}: train_data[{key!r}] has "
                                  f"{len(data[key])} entries for {len(samples)} samples")
    for i, sample in enumerate(samples):
        if "tokens" in data:
            sample.tokens = [int(t) for t in data["tokens"][i]]
        if "response_lengths" in data:
            sample.response_length = int(data["response_lengths"][i])
        if "loss_masks" in data:
            sample.loss_mask = [int(v) for v in data["loss_masks"][i]]
        if "rollout_log_probs" in data:
            sample.rollout_log_probs = [float(v) for v in data["rollout_log_probs"][i]]
        if sample.loss_mask is not None and len(sample.loss_mask) != sample.response_length:
            raise DataFormatError(f"custom_convert_samples_to_train_data_path {source}: sample {i} has a loss mask "
                                  f"of {len(sample.loss_mask)} for response length {sample.response_length}")
    rewards = [float(r) for r in data["rewards"]]
    return [float(r) for r in data.get("raw_reward", rewards)], rewards


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for row in rows for name in row})
    return {name: sum(row.get(name, 0.0) for row in rows) / len(rows) for name in names}


def slice_arrays(arrays: Any, start: int, stop: int) -> Any:
    return replace(arrays, **{f.name: getattr(arrays, f.name)[start:stop] for f in fields(arrays)
                              if getattr(arrays, f.name) is not None})


def all_reduce_dp(values: Any) -> None:
    """Sum a CPU tensor over the data-parallel group in place (through the GPU under NCCL)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() > 1:
        on = values.cuda() if torch.cuda.is_available() else values
        dist.all_reduce(on, group=parallel_state.get_data_parallel_group())
        values.copy_(on.cpu())
