"""Task `rejection_sampling`: N responses per prompt from a policy, scored; accepted ones committed as an SFT
shard set under `{store}/{run_id}/rejection_sampling/` (with every candidate beside it)."""

from __future__ import annotations

from typing import Any

from prefect.states import State

from slime.config import Config
from slime.stages.definitions import REJECTION_SAMPLING, summarize
from slime.stages.rejection_sampling import run_rejection_sampling
from tasks._cache import StageCachePolicy
from tasks._stage import finish_stage, reused, stage_task, start_stage, with_fields

CACHE = StageCachePolicy.of(REJECTION_SAMPLING, code_modules=("slime.stages.rejection_sampling",))


@stage_task("rejection_sampling", CACHE)
def rejection_sampling(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any] | State:
    """Sample `inputs["load"]` (a checkpoint or HF dir) on `inputs["prompt_data"]`; `output` is the stage directory.

    A re-run of an unfinished attempt starts over: the earlier attempt's directory is moved aside.
    """
    run_config = with_fields(config, rejection_sampling__rs_policy=inputs["load"],
                             rejection_sampling__rs_prompt_data=inputs["prompt_data"])
    phases, start = start_stage(REJECTION_SAMPLING, run_config)
    if start.output.rstrip("/") != output.rstrip("/"):
        raise RuntimeError(f"rejection_sampling writes {start.output}, the flow planned {output}")
    if start.reused is not None:
        return reused(start)
    with phases.time("sample and score"):
        result = run_rejection_sampling(run_config)
    return finish_stage(start, summarize("rejection_sampling", result, config.run.storage_options), phases)
