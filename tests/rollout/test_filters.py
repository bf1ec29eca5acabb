"""Dynamic sampling filters, the drop rule, `/get_load` parsing and response truncation (no engines)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime.errors import DataFormatError
from slime.rollout.filters import (
    DynamicFilterOutput,
    call_dynamic_filter,
    check_reward_nonzero_std,
    check_reward_nonzero_std_with_fallback,
    should_drop,
)
from slime.rollout.generate import truncate_response
from slime.rollout.http import num_requests
from slime.types import Sample, Status

ARGS = SimpleNamespace(reward_key=None)


def group(*rewards):
    return [Sample(index=i, reward=r) for i, r in enumerate(rewards)]


def test_nonzero_std_keeps_mixed_groups_and_names_the_constant_reward():
    assert check_reward_nonzero_std(ARGS, group(0.0, 1.0)) == DynamicFilterOutput(keep=True)
    out = check_reward_nonzero_std(ARGS, group(1.0, 1.0, 1.0))
    assert out == DynamicFilterOutput(keep=False, reason="zero_std_1.0")
    assert check_reward_nonzero_std(ARGS, group(0.5)).keep is False  # one sample has no spread
    fallback = check_reward_nonzero_std_with_fallback(ARGS, group(0.0, 0.0))
    assert not fallback.keep and fallback.keep_when_insufficient


def test_fan_out_trajectories_use_their_first_fragment_and_dict_rewards_need_reward_key():
    fan_out = [group(1.0, 1.0), group(0.0, 0.0)]
    assert check_reward_nonzero_std(ARGS, fan_out).keep
    dict_group = [Sample(index=0, reward={"acc": 1.0}), Sample(index=1, reward={"acc": 0.0})]
    assert check_reward_nonzero_std(SimpleNamespace(reward_key="acc"), dict_group).keep
    with pytest.raises(DataFormatError, match="set reward_key"):
        check_reward_nonzero_std(ARGS, dict_group)


def test_call_and_drop_rules():
    assert call_dynamic_filter(None, ARGS, group(1.0)).keep
    assert call_dynamic_filter(lambda args, samples: False, ARGS, group(1.0)) == DynamicFilterOutput(keep=False)
    rejected = DynamicFilterOutput(keep=False, keep_when_insufficient=True)
    assert should_drop(rejected, groups_live=5, target=4)
    assert not should_drop(rejected, groups_live=4, target=4)  # dropping it would leave too few
    assert should_drop(DynamicFilterOutput(keep=False), groups_live=1, target=4)
    assert not should_drop(DynamicFilterOutput(keep=True), groups_live=9, target=4)


def test_num_requests_reads_sglang_and_builtin_loads():
    assert num_requests([{"dp_rank": 0, "num_reqs": 3}, {"dp_rank": 1, "num_reqs": 2}]) == 5
    assert num_requests({"num_running_reqs": 1, "num_waiting_reqs": 4}) == 5
    assert num_requests([]) == 0 and num_requests("busy") == 0


def test_truncate_response_cuts_every_per_token_list():
    s = Sample(index=0, tokens=[1, 2, 3, 4, 5, 6], response_length=4, loss_mask=[1, 0, 1, 1],
               rollout_log_probs=[-0.1, 0.0, -0.3, -0.4], status=Status.COMPLETED, response="abcd")
    assert not truncate_response(s, 4)
    assert truncate_response(s, 2)
    s.validate()
    assert s.tokens == [1, 2, 3, 4] and s.loss_mask == [1, 0] and s.rollout_log_probs == [-0.1, 0.0]
    assert s.status is Status.TRUNCATED and s.response == "abcd"  # no tokenizer: text left as it was
