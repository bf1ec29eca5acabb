"""Rollout: turn prompt groups into scored samples through the engines behind the router.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` is the default
`rollout_function_path` (slime's signature); rewards live in `slime.rollout.rewards`. docs/rollout.md
describes the flags, plugin signatures, metrics, partial rollout and eval.
"""

from slime.rollout.eval import eval_rollout
from slime.rollout.filters import (
    DynamicFilterOutput,
    check_reward_nonzero_std,
    check_reward_nonzero_std_with_fallback,
)
from slime.rollout.hooks import check_rollout_plugins, load_rollout_function
from slime.rollout.http import rollout_args
from slime.rollout.outputs import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.rollout import FilterStarvedError, generate_rollout, generate_rollout_async
from slime.rollout.state import RolloutEngineError

__all__ = [
    "DynamicFilterOutput",
    "FilterStarvedError",
    "RolloutEngineError",
    "RolloutFnEvalOutput",
    "RolloutFnTrainOutput",
    "check_reward_nonzero_std",
    "check_reward_nonzero_std_with_fallback",
    "check_rollout_plugins",
    "eval_rollout",
    "generate_rollout",
    "generate_rollout_async",
    "load_rollout_function",
    "rollout_args",
]
