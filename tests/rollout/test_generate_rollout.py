"""generate_rollout against two built-in engines behind the real sglang-router (one cluster per module).

Covers issue 4's "Must show" items for rollout: over-sampling + a filter that drops half the groups + abort
gives exactly rollout_batch_size groups and leaves no request on any engine; reward exceptions and engine
errors are counted outcomes with the accounting balanced; bad plugins fail before any generation.
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import engine_requests

from slime.data.prompts import load_prompts
from slime.data.source import RolloutDataSource
from slime.errors import AlreadyCommittedError
from slime.net import find_free_port
from slime.plugins import PluginError
from slime.rollout import (
    FilterStarvedError,
    RolloutEngineError,
    check_reward_nonzero_std,
    generate_rollout,
    load_rollout_function,
)
from slime.storage import read_samples
from slime.types import Status

DROP_KEYS = ("kept", "filtered", "failed", "aborted_dropped", "to_buffer")


def balanced(metrics: dict) -> bool:
    return metrics["rollout/groups/drawn"] == sum(metrics[f"rollout/groups/{k}"] for k in DROP_KEYS)


def source(tiny_kit, args, path=None) -> RolloutDataSource:
    return RolloutDataSource(load_prompts(str(path or tiny_kit.train)), n_samples_per_prompt=args.n_samples_per_prompt,
                             args=args)


def generated_tokens(engines) -> int:
    with httpx.Client(timeout=30, trust_env=False) as http:
        return sum(http.get(f"{url}/server_info").json()["internal_states"][0]["generated_tokens"]
                   for _, url in engines)


def test_over_sampling_filter_and_abort_keep_exactly_the_batch(cluster, make_args, tiny_kit, tmp_path):
    _, engines = cluster
    args = make_args(rollout_batch_size=4, over_sampling_batch_size=6, sglang_server_concurrency=2,
                     rollout_max_response_len=12, custom_rm_path="rollout_plugins.rm_parity",
                     dynamic_sampling_filter_path="slime.rollout.check_reward_nonzero_std",
                     rollout_sample_filter_path="rollout_plugins.mark_short_removed",
                     rollout_all_samples_process_path="rollout_plugins.record_all_samples",
                     run_id="filter", store=str(tmp_path / "store"))
    data_source = source(tiny_kit, args)
    out = generate_rollout(args, 0, data_source)
    m = out.metrics

    assert len(out.samples) == 4 and all(len(g) == 2 for g in out.samples)
    for group in out.samples:  # the filter's verdict holds for every kept group
        assert check_reward_nonzero_std(args, group).keep
        assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in group)
        for s in group:
            s.validate()
            assert s.response_length <= 12 and len(s.rollout_log_probs) == s.response_length
            assert s.loss_mask == [1] * s.response_length and s.weight_versions == ["default"]
    # rm_parity makes every odd group zero-std: the filter dropped some, over-sampling replaced them
    assert m["rollout/groups/filtered"] >= 2 and m["rollout/groups/filtered"] == m["rollout/groups/zero_std"]
    assert m["rollout/dynamic_filter/drop_zero_std_1.0"] == m["rollout/groups/filtered"]
    assert m["rollout/groups/drawn"] >= 12 and m["rollout/groups/drawn"] % 6 == 0
    assert m["rollout/groups/aborted_dropped"] >= 1 and m["rollout/groups/to_buffer"] == 0
    assert balanced(m), m
    assert engine_requests(engines) == [0, 0]  # nothing left running after the abort
    assert data_source.buffer == []
    # kept groups are sorted by index and are what was written to the store
    indices = [g[0].index for g in out.samples]
    assert indices == sorted(indices)
    stored = read_samples(m["rollout/uri"])
    assert [s.index for s in stored] == [s.index for g in out.samples for s in g]
    assert stored[0].tokens == out.samples[0][0].tokens
    dropped = read_samples(m["rollout/uri"].replace("/rollout/", "/rollout_dropped/"))
    assert len(dropped) == 2 * (m["rollout/groups/drawn"] - 4)
    # hooks ran once each; the all-samples hook saw every group that finished or was aborted
    from rollout_plugins import CALLS
    assert CALLS["sample_filter"][-1] == 4
    assert CALLS["all_samples"][-1] == m["rollout/groups/drawn"]
    assert m["rollout/samples_per_s"] > 0 and m["rollout/tokens_per_s"] > 0
    assert m["rollout/response_len/max"] <= 12


def test_reward_exception_fails_its_group_and_counts_balance(make_args, tiny_kit, tmp_path):
    args = make_args(rollout_batch_size=4, custom_rm_path="rollout_plugins.rm_raises_on_index_1_mod_8",
                     run_id="rm-error", store=str(tmp_path / "store"))
    data_source = source(tiny_kit, args)
    out = generate_rollout(args, 3, data_source)
    m = out.metrics
    assert len(out.samples) == 4
    assert all(s.status is not Status.FAILED and s.reward == 1.0 for g in out.samples for s in g)
    assert all(g[1].index % 8 != 1 for g in out.samples)
    assert m["rollout/groups/failed"] >= 1 and m["rollout/samples/failed"] == m["rollout/groups/failed"]
    assert balanced(m), m
    dropped = read_samples(m["rollout/uri"].replace("/rollout/", "/rollout_dropped/"))
    failed = [s for s in dropped if s.status is Status.FAILED]
    assert len(failed) == m["rollout/samples/failed"]
    assert all(s.metadata["reward_error"] == f"ValueError: grader crashed on sample {s.index}" for s in failed)
    # the step is committed: running it again fails at set-up, before drawing a prompt
    state = data_source.state_dict()
    with pytest.raises(AlreadyCommittedError, match="000003 is already committed"):
        generate_rollout(args, 3, data_source)
    assert data_source.state_dict() == state


def test_engine_refusing_one_request_fails_that_sample(make_args, tiny_kit, tmp_path):
    # one prompt longer than the engine's 512-token context: the engine answers HTTP 400 for it
    rows = [{"prompt": "1+1=" * 200, "label": "2"}] + [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(8)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = make_args(rollout_batch_size=3, custom_rm_path="rollout_plugins.rm_one")
    out = generate_rollout(args, 0, source(tiny_kit, args, path))
    m = out.metrics
    assert len(out.samples) == 3 and all(g[0].group_index != 0 for g in out.samples)
    assert m["rollout/groups/failed"] == 1 and m["rollout/samples/failed"] == 2
    assert balanced(m), m


def test_bad_plugins_fail_before_any_generation(cluster, make_args, tiny_kit):
    _, engines = cluster
    before = generated_tokens(engines)
    cases = {
        "custom_generate_function_path": ("rollout_plugins.no_such_fn", "has no attribute"),
        "dynamic_sampling_filter_path": ("no_such_module.fn", "cannot import module"),
        "rollout_sample_filter_path": ("rollout_plugins", "expected a dotted path"),
    }
    for field, (path, message) in cases.items():
        args = make_args(**{field: path}, custom_rm_path="rollout_plugins.rm_one")
        data_source = source(tiny_kit, args)
        state = data_source.state_dict()
        with pytest.raises(PluginError, match=message) as info:
            generate_rollout(args, 0, data_source)
        assert field in str(info.value)
        assert data_source.state_dict() == state  # no prompt was drawn
    signature_cases = {
        "custom_generate_function_path": ("rollout_plugins.generate_missing_param", "signature"),
        "custom_rm_path": ("rollout_plugins.generate_not_async", "async def"),
        "dynamic_sampling_filter_path": ("rollout_plugins.filter_wrong_arity", "signature"),
    }
    for field, (path, message) in signature_cases.items():
        args = make_args(**{"custom_rm_path": "rollout_plugins.rm_one", field: path})
        with pytest.raises(PluginError, match=message):
            generate_rollout(args, 0, source(tiny_kit, args))
    assert generated_tokens(engines) == before


def test_unreachable_router_is_a_clear_error_and_draws_nothing(make_args, tiny_kit):
    args = make_args(custom_rm_path="rollout_plugins.rm_one")
    args.sglang_router_port = find_free_port("127.0.0.1")
    data_source = source(tiny_kit, args)
    state = data_source.state_dict()
    with pytest.raises(RolloutEngineError, match="cannot list the workers of router"):
        generate_rollout(args, 0, data_source)
    assert data_source.state_dict() == state


def test_custom_generate_response_is_cut_to_max_response_len(make_args, tiny_kit):
    args = make_args(rollout_batch_size=2, rollout_max_response_len=6, custom_rm_path="rollout_plugins.rm_one",
                     custom_generate_function_path="rollout_plugins.generate_too_long")
    out = generate_rollout(args, 0, source(tiny_kit, args))
    for s in (s for g in out.samples for s in g):
        s.validate()
        assert s.response_length == 6 and s.status is Status.TRUNCATED
        assert s.tokens == [49, 43, 50, 61, 70, 71, 72, 73, 74, 75]
        assert s.rollout_log_probs == [-1.0] * 6


def test_sampling_params_come_from_the_config(make_args):
    from slime.rollout.generate import sampling_params_from_args

    args = make_args(rollout_temperature=0.5, rollout_top_p=0.9, rollout_top_k=5, rollout_stop=["\n"],
                     rollout_stop_token_ids=[3], rollout_skip_special_tokens=True, rollout_max_response_len=7,
                     eval_temperature=0.1, eval_max_response_len=3)
    assert sampling_params_from_args(args) == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "max_new_tokens": 7, "stop": ["\n"], "stop_token_ids": [3],
        "skip_special_tokens": True, "no_stop_trim": True, "spaces_between_special_tokens": False}
    ev = sampling_params_from_args(args, evaluation=True)
    assert ev["temperature"] == 0.1 and ev["max_new_tokens"] == 3 and ev["top_p"] == 0.9




def test_plugins_reach_the_router_and_sampling_settings_through_args(make_args, tiny_kit):
    args = make_args(rollout_batch_size=2, rollout_temperature=0.7, rollout_max_response_len=4,
                     custom_generate_function_path="rollout_plugins.generate_with_own_client",
                     custom_rm_path="rollout_plugins.rm_one")
    out = generate_rollout(args, 0, source(tiny_kit, args))
    for s in (s for g in out.samples for s in g):
        assert s.metadata["seen"]["temperature"] == 0.7
        assert s.metadata["seen"]["params"]["temperature"] == 0.7
        assert s.metadata["seen"]["params"]["max_new_tokens"] == 4
        assert 1 <= s.response_length <= 4 and len(s.rollout_log_probs) == s.response_length


def test_group_rm_scores_each_group_in_one_call(make_args, tiny_kit):
    args = make_args(rollout_batch_size=2, n_samples_per_prompt=3, group_rm=True,
                     custom_rm_path="rollout_plugins.group_rm_by_position")
    out = generate_rollout(args, 0, source(tiny_kit, args))
    assert [[s.reward for s in g] for g in out.samples] == [[0.0, 1.0, 2.0]] * 2


def test_fan_out_generate_keeps_fragments_together(make_args, tiny_kit, tmp_path):
    args = make_args(rollout_batch_size=2, custom_generate_function_path="rollout_plugins.generate_fan_out",
                     custom_rm_path="rollout_plugins.rm_one", run_id="fan", store=str(tmp_path / "store"))
    out = generate_rollout(args, 0, source(tiny_kit, args))
    assert len(out.samples) == 2 and all(len(g) == 2 and all(len(t) == 2 for t in g) for g in out.samples)
    assert out.metrics["rollout/samples"] == 8
    assert len(read_samples(out.metrics["rollout/uri"])) == 8
    assert all(t[1].metadata["fragment"] == 1 and t[1].tokens == t[0].tokens for g in out.samples for t in g)


def test_filter_that_never_keeps_raises_instead_of_looping(make_args, tiny_kit):
    args = make_args(rollout_batch_size=1, over_sampling_batch_size=1, rollout_max_response_len=2,
                     custom_rm_path="rollout_plugins.rm_one",
                     dynamic_sampling_filter_path="slime.rollout.check_reward_nonzero_std")
    data_source = source(tiny_kit, args)
    with pytest.raises(FilterStarvedError, match=r"dropped 20 groups in a row \(kept 0/1; reasons "
                                                 r"\{'zero_std_1.0': 20\}\)"):
        generate_rollout(args, 0, data_source)
    assert data_source.sample_group_index == 20  # exactly the groups it judged


def test_rollout_function_path_is_loaded_and_checked(make_args, tiny_kit):
    args = make_args(rollout_batch_size=1, rollout_function_path="rollout_plugins.my_rollout",
                     custom_rm_path="rollout_plugins.rm_one")
    out = load_rollout_function(args)(args, 0, source(tiny_kit, args))
    assert out.metrics["custom"] is True and len(out.samples) == 1
    args.rollout_function_path = "rollout_plugins.rollout_missing_data_source"
    with pytest.raises(PluginError, match="rollout_function_path"):
        load_rollout_function(args)
