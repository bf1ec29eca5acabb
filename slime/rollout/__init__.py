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
from slime.rollout.hooks import check_rollout_plugins
from slime.rollout.http import rollout_args
from slime.rollout.outputs import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.rollout import generate_rollout, generate_rollout_async
from slime.rollout.state import RolloutEngineError

__all__ = [
    "DynamicFilterOutput",
    "RolloutEngineError",
    "RolloutFnEvalOutput",
    "RolloutFnTrainOutput",
    "check_reward_nonzero_std",
    "check_reward_nonzero_std_with_fallback",
    "check_rollout_plugins",
    "eval_rollout",
    "generate_rollout",
    "generate_rollout_async",
    "rollout_args",
]
