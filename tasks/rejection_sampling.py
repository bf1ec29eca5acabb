"""Task `rejection_sampling`: N responses per prompt from a policy, scored; accepted ones committed as an SFT
shard set under `{store}/{run_id}/rejection_sampling/` (with every candidate beside it)."""

from __future__ import annotations

from typing import Any

from slime.config import Config
from slime.stages.rejection_sampling import run_rejection_sampling
from slime.storage import manifest_hash
from tasks._cache import StageCachePolicy
from tasks._stage import stage_result, stage_task, start_stage, with_fields

# what the sampled and accepted set depends on besides the policy and the prompts (inputs)
CONFIG_FIELDS = ("rejection_sampling", "rollout", "reward", "data", "engine", "sglang", "run.seed")

CACHE = StageCachePolicy(config_fields=CONFIG_FIELDS, code_modules=("slime.stages.rejection_sampling",))


@stage_task("rejection_sampling", CACHE)
def rejection_sampling(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any]:
    """Sample `inputs["load"]` (a checkpoint or HF dir) on `inputs["prompt_data"]`; `output` is the stage directory.

    A re-run (no intact cached result) starts over: the earlier attempt's directory is moved aside.
    """
    phases = start_stage(CACHE, config, inputs, output)
    with phases.time("sample and score"):
        result = run_rejection_sampling(with_fields(config, rejection_sampling__rs_policy=inputs["load"],
                                                    rejection_sampling__rs_prompt_data=inputs["prompt_data"]))
    options = config.run.storage_options
    artifacts = {name: (result[key], manifest_hash(result[key], options))
                 for name, key in (("accepted", "output"), ("candidates", "candidates"))}
    metrics = {k: v for k, v in result.items() if k not in ("output", "candidates")}
    return stage_result("rejection_sampling", artifacts, metrics, phases)
