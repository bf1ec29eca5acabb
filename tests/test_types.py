import json

import pytest

from slime.errors import DataFormatError
from slime.types import Sample


def _sample(**kw):
    base = dict(
        group_index=3, index=7, prompt=[{"role": "user", "content": "1+1="}], tokens=[5, 6, 7, 8],
        response="2", response_length=2, label="2", reward={"score": 1.0, "acc": True}, loss_mask=[1, 0],
        rollout_log_probs=[-0.5, -1.25], status=Sample.Status.TRUNCATED, metadata={"tools": [{"name": "calc"}]},
        weight_versions=["3"],
    )
    base.update(kw)
    return Sample(**base)


def test_status_is_nested_with_slime_values():
    assert [s.value for s in Sample.Status] == ["pending", "completed", "truncated", "aborted", "failed"]
    assert Sample().status is Sample.Status.PENDING


def test_to_dict_is_json_and_round_trips():
    sample = _sample()
    sample.spec_info.spec_accept_token_num = 4
    sample.prefix_cache_info.cached_tokens = 9
    data = json.loads(json.dumps(sample.to_dict()))
    assert data["status"] == "truncated"
    assert data["prefix_cache_info"] == {"cached_tokens": 9, "total_prompt_tokens": 0}
    back = Sample.from_dict(data)
    assert back == sample
    assert back.status is Sample.Status.TRUNCATED


def test_from_dict_rejects_unknown_fields_and_bad_status():
    with pytest.raises(DataFormatError, match=r"unknown field\(s\) \['tokenz'\]"):
        Sample.from_dict({"tokenz": [1]})
    with pytest.raises(DataFormatError, match="'status' is 'done'"):
        Sample.from_dict({"status": "done"})


def test_update_from_meta_info_maps_finish_reason_and_version():
    sample = _sample(status=Sample.Status.PENDING, weight_versions=[])
    meta = {"finish_reason": {"type": "abort"}, "weight_version": "v2", "prompt_tokens": 4, "cached_tokens": 3}
    sample.update_from_meta_info(None, meta)
    assert sample.status is Sample.Status.ABORTED
    assert sample.weight_versions == ["v2"]
    assert sample.prefix_cache_info.prefix_cache_hit_rate == 0.75
    sample.update_from_meta_info(None, {"finish_reason": {"type": "length"}})
    assert sample.status is Sample.Status.TRUNCATED


def test_reward_value_with_and_without_key():
    class Args:
        reward_key = "score"

    assert _sample().get_reward_value(Args) == 1.0
    assert _sample(reward=0.5).get_reward_value(None) == 0.5
    with pytest.raises(DataFormatError, match="set reward_key"):
        _sample().get_reward_value(None)


def test_validate_catches_length_mismatch():
    _sample().validate()
    with pytest.raises(DataFormatError, match=r"len\(loss_mask\)=3 but response_length=2"):
        _sample(loss_mask=[1, 1, 1]).validate()
    with pytest.raises(DataFormatError, match="outside"):
        _sample(response_length=9).validate()
    assert _sample().effective_response_length == 1
