"""The reward hub: built-in graders (math, math_verify, dapo, deepscaler, f1, gpqa, remote_rm, random, `boxed_`),
custom and group reward plugins, and the failure policy. See docs/rewards.md."""

from slime.rollout.rewards.hub import (
    RM_TYPES,
    RewardTypeError,
    check_reward_config,
    compute_reward,
    reward_samples,
)

__all__ = ["RM_TYPES", "RewardTypeError", "check_reward_config", "compute_reward", "reward_samples"]
