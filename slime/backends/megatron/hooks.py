"""slime's Megatron-side hooks, with slime's signatures, loaded and signature-checked when a train rank
starts (so a typo fails before any step):

| flag | called as | when |
|---|---|---|
| `--custom-megatron-init-path` | `init(args)` | after Megatron's process groups are set up, before the model is built |
| `--custom-megatron-before-log-prob-hook-path` | `hook(args, model, store_prefix)` | before each log-prob pass: `""` for the actor's old log-probs, `"ref_"` for the reference model's |
| `--custom-megatron-before-train-step-hook-path` | `hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)` | before each optimizer step of a rollout (`step_id` from 0) |
| `--custom-advantage-function-path` | `fn(args, rollout_data)`, sets `rollout_data["advantages"]` and `["returns"]` | instead of the built-in estimator (whitening with `--normalize-advantages` still follows) |
| `--rollout-data-postprocess-path` | `fn(args, rollout_id, rollout_data)` | after the advantages; changes to `advantages` and `loss_masks` are trained on |
| `--custom-reward-post-process-path` | `fn(args, samples)` -> `(raw_rewards, rewards)` | instead of the group normalisation of the whole batch's rewards (every rank calls it on the same samples) |

`rollout_data` holds this rank's samples as slime's lists, one entry per sample, response-aligned:
`rewards` (group-normalised), `raw_reward`, `log_probs` (the trainer's old log-probs), `ref_log_probs`
(or None), `rollout_log_probs`, `kl`, `loss_masks` (int tensors), `response_lengths`, `total_lengths`,
`tokens`, and after the advantages `advantages` and `returns`.

`model` is the list of model chunks, `optimizer` megatron-core's optimizer and `opt_param_scheduler` its
`OptimizerParamScheduler`, as in slime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.plugins import load_plugin_field

INIT_PARAMS = ["args"]
BEFORE_LOG_PROB_PARAMS = ["args", "model", "store_prefix"]
BEFORE_TRAIN_STEP_PARAMS = ["args", "rollout_id", "step_id", "model", "optimizer", "opt_param_scheduler"]
ADVANTAGE_PARAMS = ["args", "rollout_data"]
POSTPROCESS_PARAMS = ["args", "rollout_id", "rollout_data"]
REWARD_POST_PROCESS_PARAMS = ["args", "samples"]


@dataclass
class MegatronHooks:
    """The configured hooks (None: not set)."""

    init: Callable[..., Any] | None = None
    before_log_prob: Callable[..., Any] | None = None
    before_train_step: Callable[..., Any] | None = None
    advantage: Callable[..., Any] | None = None
    rollout_data_postprocess: Callable[..., Any] | None = None
    reward_post_process: Callable[..., Any] | None = None


def load_megatron_hooks(args: Any) -> MegatronHooks:
    """Load and check every Megatron hook named in `args` (slime's flat args)."""
    return MegatronHooks(
        init=load_plugin_field(args, "custom_megatron_init_path", INIT_PARAMS, is_async=False),
        before_log_prob=load_plugin_field(args, "custom_megatron_before_log_prob_hook_path", BEFORE_LOG_PROB_PARAMS,
                                          is_async=False),
        before_train_step=load_plugin_field(args, "custom_megatron_before_train_step_hook_path",
                                            BEFORE_TRAIN_STEP_PARAMS, is_async=False),
        advantage=load_plugin_field(args, "custom_advantage_function_path", ADVANTAGE_PARAMS, is_async=False),
        rollout_data_postprocess=load_plugin_field(args, "rollout_data_postprocess_path", POSTPROCESS_PARAMS,
                                                   is_async=False),
        reward_post_process=load_plugin_field(args, "custom_reward_post_process_path", REWARD_POST_PROCESS_PARAMS,
                                              is_async=False),
    )
