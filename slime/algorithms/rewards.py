"""Group reward normalisation: the baseline of GRPO-style estimators.

The N = n_prompts * group_size rewards of a rollout come as consecutive groups of
``group_size`` samples of the same prompt. Within a group g with rewards r_1..r_n:

    r_i' = r_i - mean_g(r)                      (subtract_mean)
    r_i' = r_i' / (std_g(r) + eps)              (divide_std; std with Bessel's correction, n - 1)

Which estimator normalises how (slime ``RolloutManager._post_process_rewards`` in THUDM/slime
``slime/ray/rollout.py``; flags in ``slime/utils/arguments.py``):

    grpo, gspo, cispo               mean and std  (Dr. GRPO: --disable-grpo-std-normalization
                                                   keeps the mean only, arXiv:2503.20783)
    reinforce_plus_plus_baseline    mean only
    reinforce_plus_plus, ppo        raw rewards
    --disable-rewards-normalization raw rewards for every estimator
    group_size == 1                 std off (one sample has no spread)

Departure: when N is not a multiple of ``group_size`` slime treats the whole batch as one group;
here that is an error, since it almost always means the groups were assembled wrongly.

``--custom-reward-post-process-path`` replaces all of this, as in slime: ``fn(args, samples)`` returns
``(raw_rewards, rewards)`` for the batch (``custom_rewards``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from slime.algorithms.advantages import ESTIMATORS

# Estimators whose rewards are centred on the group mean, and the subset also scaled by the std.
_MEAN_CENTRED = frozenset({"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"})
_STD_SCALED = frozenset({"grpo", "gspo", "cispo"})


class GroupNormalization(NamedTuple):
    """Keyword arguments of ``normalize_group_rewards`` chosen for an estimator."""

    subtract_mean: bool
    divide_std: bool


def group_normalization_for(
    estimator: str,
    group_size: int,
    *,
    disable_rewards_normalization: bool = False,
    disable_grpo_std_normalization: bool = False,
) -> GroupNormalization:
    """How slime normalises the rewards of ``estimator`` (table in the module docstring).

    Use as ``normalize_group_rewards(r, n, **group_normalization_for(...)._asdict())``.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    subtract_mean = estimator in _MEAN_CENTRED and not disable_rewards_normalization
    divide_std = (
        subtract_mean and estimator in _STD_SCALED and not disable_grpo_std_normalization and group_size > 1
    )
    return GroupNormalization(subtract_mean=subtract_mean, divide_std=divide_std)


def normalize_group_rewards(
    rewards: torch.Tensor,
    group_size: int,
    *,
    subtract_mean: bool = True,
    divide_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Normalise rewards within consecutive groups of ``group_size`` samples.

    Args:
        rewards: ``[N]`` scalar rewards, N a multiple of ``group_size``, groups contiguous.
        group_size: samples per prompt (``n_samples_per_prompt``).
        subtract_mean: subtract each group's mean.
        divide_std: divide by each group's (unbiased) std plus ``eps``; skipped when
            ``group_size == 1``. A group of equal rewards becomes all zeros with the mean on.
        eps: added to the std, slime's 1e-6.

    Returns:
        ``[N]`` float32 normalised rewards, same order as the input.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().reshape(-1, group_size)  # [N / group_size, group_size]
    if subtract_mean:
        grouped = grouped - grouped.mean(dim=-1, keepdim=True)
    if divide_std and group_size > 1:
        grouped = grouped / (grouped.std(dim=-1, keepdim=True) + eps)
    return grouped.reshape(-1)


def custom_rewards(fn: Callable[[Any, list[Any]], Any], args: Any, samples: list[Any],
                   where: str) -> tuple[list[float], list[float]]:
    """slime's ``--custom-reward-post-process-path``: ``fn(args, samples)`` -> ``(raw_rewards, rewards)``, one
    number each per sample, in place of the estimator's group normalisation. A result of another shape raises
    ValueError naming ``where`` (the plugin's path) and what came back."""
    out = fn(args, samples)
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise ValueError(f"{where} must return (raw_rewards, rewards), got {type(out).__name__}")
    pair: list[list[float]] = []
    for name, values in zip(("raw_rewards", "rewards"), out, strict=True):
        if not isinstance(values, Sequence | torch.Tensor) or len(values) != len(samples):
            size = len(values) if isinstance(values, Sequence | torch.Tensor) else type(values).__name__
            raise ValueError(f"{where} returned {name} of {size} for {len(samples)} samples: one number per sample")
        try:
            pair.append([float(v) for v in values])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where} returned {name} that are not numbers: {exc}") from None
    return pair[0], pair[1]
