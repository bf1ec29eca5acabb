"""Plugins the fully async tests name by dotted path (`async_plugins.<fn>`), with slime's signatures."""

from __future__ import annotations

import time

from slime.rollout import generate_rollout
from slime.rollout.generate import generate
from slime.types import Sample, Status

FINISHED_LONG: set[tuple[int, int]] = set()  # samples whose long first attempt is over
LONG_TOKENS = 400


async def rm_one(args, sample: Sample) -> float:
    return 1.0


async def long_every_fourth_group(args, sample: Sample, sampling_params: dict) -> Sample:
    """The default generate, except that the first attempt at a group with index % 4 == 0 runs to
    LONG_TOKENS tokens with no stop tokens (a slow, long reasoning trace): it is cut by every weight update
    it is in flight for and continues after it, so its oldest tokens fall behind. A regenerated copy (same
    ids) is short. The response is cut back to rollout_max_response_len when it finishes."""
    key = (sample.group_index, sample.index)
    if sample.group_index % 4 == 0 and key not in FINISHED_LONG:
        sampling_params = {**sampling_params, "max_new_tokens": LONG_TOKENS, "stop_token_ids": []}
        sample = await generate(args, sample, sampling_params)
        if sample.status is not Status.ABORTED:
            FINISHED_LONG.add(key)
        return sample
    return await generate(args, sample, sampling_params)


EVAL_SLEEP_S = 5.0


def slow_eval(args, rollout_id: int, data_source, evaluation: bool = False):
    """slime's eval after EVAL_SLEEP_S: an eval that spans training steps (the eval fleet's tests)."""
    time.sleep(EVAL_SLEEP_S)
    return generate_rollout(args, rollout_id, data_source, evaluation=evaluation)
