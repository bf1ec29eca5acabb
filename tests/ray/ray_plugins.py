"""Plugins named by dotted path in the Ray tests (importable in the actors: same sys.path as the driver)."""

from slime.types import Sample


async def rm_by_index(args, sample: Sample) -> float:
    """Rewards 0 and 1 alternating within every group: GRPO advantages are non-zero whatever the
    random tiny model writes."""
    return float(sample.index % 2)


# ----------------------------------------------------------------------------- slime's rollout-side hooks
# Each written to the signature slime calls it with (slime/rollout/sample_hooks.py,
# slime/observability/rollout_metrics.py, slime/ray/rollout.py); CALLS records what they were given.

CALLS: dict[str, list] = {"rollout_log": [], "eval_log": [], "eval_fn": []}


def tag_sample(args, sample: Sample, *, rollout_id=None, evaluation=False):
    """--rollout-sample-hook-path, sync, keyword arguments named: returns None (keeps the sample)."""
    sample.metadata.setdefault("hooks", []).append(["tag", rollout_id, evaluation])


async def count_hooks(args, sample: Sample, **kwargs) -> Sample:
    """--rollout-sample-hook-path, async, **kwargs: runs second, returns the sample."""
    sample.metadata["hooks"].append(["count", kwargs["rollout_id"], kwargs["evaluation"]])
    return sample


async def rm_hook_count(args, sample: Sample) -> float:
    """The reward is the number of hooks that ran on the sample: 2.0 when both ran before it."""
    return float(len(sample.metadata.get("hooks", [])))


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    """--custom-rollout-log-function-path: records, and takes over the logging (True)."""
    CALLS["rollout_log"].append({"rollout_id": rollout_id, "samples": len(samples), "rewards":
                                 [s.reward for s in samples], "reward_mean": rollout_extra_metrics.get(
                                     "rollout/reward/mean"), "rollout_time": rollout_time,
                                 "custom": getattr(args, "my_custom_setting", None)})
    return True


def log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool:
    """--custom-eval-rollout-log-function-path: records, leaves the default logging on (False)."""
    CALLS["eval_log"].append({"rollout_id": rollout_id, "rewards": {k: v["rewards"] for k, v in data.items()},
                              "hooks": [s.metadata["hooks"] for v in data.values() for s in v["samples"]],
                              "metric_keys": sorted(extra_metrics)})
    return False


def eval_rollout_fn(args, rollout_id, data_source, evaluation=False):
    """--eval-function-path: slime's rollout-function signature; delegates to the default rollout."""
    from slime.rollout import generate_rollout

    CALLS["eval_fn"].append({"rollout_id": rollout_id, "evaluation": evaluation})
    return generate_rollout(args, rollout_id, data_source, evaluation=evaluation)


# ----------------------------------------------------------------------------- slime's Megatron hooks
# Written to slime's signatures (slime/backends/megatron_utils/initialize.py and model.py); each appends
# what it was given to the JSON-lines file `args.hook_log` (an attribute from --custom-config-path).


def _record(args, entry: dict) -> None:
    import json

    with open(args.hook_log, "a") as f:
        f.write(json.dumps(entry) + "\n")


def megatron_init(args) -> None:
    import os

    import torch.distributed as dist

    _record(args, {"hook": "init", "dist_initialized": dist.is_initialized(), "seed": args.seed,
                   "env": os.environ.get("SLIME_HOOK_TEST")})


def before_log_prob(args, model, store_prefix) -> None:
    _record(args, {"hook": "log_prob", "store_prefix": store_prefix, "chunks": len(model)})


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    params = dict(model[0].named_parameters())

    def total(part: str) -> float:
        return sum(float(p.detach().double().sum()) for n, p in params.items() if part in n)

    _record(args, {"hook": "train_step", "rollout_id": rollout_id, "step_id": step_id, "chunks": len(model),
                   "lr": optimizer.param_groups[0]["lr"], "scheduler_steps": opt_param_scheduler.num_steps,
                   "frozen": sorted(n for n, p in params.items() if not p.requires_grad),
                   "embedding_sum": total("word_embeddings"), "fc1_sum": total("linear_fc1")})


def constant_advantages(args, rollout_data) -> None:
    """--custom-advantage-function-path: every token's advantage 1 (returns too); records the keys it got."""
    import torch

    _record(args, {"hook": "advantage", "keys": sorted(rollout_data), "samples": len(rollout_data["rewards"]),
                   "lengths_match": all(len(lp) == n for lp, n in zip(rollout_data["log_probs"],
                                                                       rollout_data["response_lengths"], strict=True))})
    rollout_data["advantages"] = [torch.ones(n) for n in rollout_data["response_lengths"]]
    rollout_data["returns"] = [torch.ones(n) for n in rollout_data["response_lengths"]]


def double_advantages(args, rollout_id, rollout_data) -> None:
    """--rollout-data-postprocess-path: doubles the advantages the trainer then uses."""
    _record(args, {"hook": "postprocess", "rollout_id": rollout_id})
    rollout_data["advantages"] = [2 * a for a in rollout_data["advantages"]]


async def generate_other_experts(args, sample: Sample, sampling_params) -> Sample:
    """--custom-generate-function-path: slime's generate, then every MoE layer's recorded expert e replaced by
    (e + E/2) mod E (E: the model's routed experts; a dense layer's -1 kept): the trainer, replaying these (R3),
    routes every token elsewhere than the engine did (tests/rl/test_rl_glm4_moe.py)."""
    from transformers import AutoConfig

    from slime.rollout.generate import generate

    sample = await generate(args, sample, sampling_params)
    experts = AutoConfig.from_pretrained(args.hf_checkpoint).n_routed_experts
    sample.rollout_routed_experts = [[e if e < 0 else (e + experts // 2) % experts for e in row]
                                     for row in sample.rollout_routed_experts]
    return sample
