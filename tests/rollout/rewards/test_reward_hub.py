"""reward_samples / compute_reward / check_reward_config: dispatch, failures, group and custom rewards."""

from __future__ import annotations

import asyncio
import time
from argparse import Namespace

import pytest

from slime.config import load_config
from slime.errors import ConfigError
from slime.plugins import PluginError
from slime.rollout.rewards import RewardTypeError, check_reward_config, compute_reward, reward_samples
from slime.types import Sample, Status


def args(**kw) -> Namespace:
    base = {"rm_type": None, "rm_url": None, "custom_rm_path": None, "group_rm": False, "reward_key": None}
    return Namespace(**{**base, **kw})


def samples(*pairs, **kw) -> list[Sample]:
    return [Sample(index=i, response=r, label=label, **kw) for i, (r, label) in enumerate(pairs)]


def test_rm_type_math_verify_sets_rewards_and_keeps_status():
    batch = samples(("19<|im_end|>", "19"), ("18<|im_end|>", "19"), ("", "19"))
    for s in batch:
        s.status = Status.COMPLETED
    asyncio.run(reward_samples(args(rm_type="math_verify"), batch))
    assert [s.reward for s in batch] == [1.0, 0.0, 0.0]
    assert all(s.status is Status.COMPLETED for s in batch)


def test_rm_type_math_needs_a_boxed_answer_as_slime():
    batch = samples(("19<|im_end|>", "19"), ("so \\boxed{19}<|im_end|>", "19"))
    asyncio.run(reward_samples(args(rm_type="math"), batch))
    assert [s.reward for s in batch] == [0.0, 1.0]


def test_metadata_rm_type_overrides_config():
    batch = samples(("Paris France", "Paris"), ("19", "19"))
    batch[0].metadata["rm_type"] = "f1"
    asyncio.run(reward_samples(args(rm_type="math_verify"), batch))
    assert batch[0].reward == pytest.approx(2 / 3) and batch[1].reward == 1.0


def test_aborted_samples_are_left_alone():
    batch = samples(("19", "19"), ("19", "19"))
    batch[1].status = Status.ABORTED
    asyncio.run(reward_samples(args(rm_type="math_verify"), batch))
    assert batch[0].reward == 1.0
    assert batch[1].reward is None and batch[1].status is Status.ABORTED


def test_raising_reward_marks_only_that_sample_failed(make_module):
    mod = make_module("""
        async def rm(args, sample):
            if sample.response == "boom":
                raise ValueError(f"cannot grade {sample.index}")
            return len(sample.response)
    """)
    batch = samples(("ok", None), ("boom", None), ("okay", None))
    asyncio.run(reward_samples(args(custom_rm_path=f"{mod}.rm"), batch))
    assert [s.reward for s in batch] == [2.0, None, 4.0]
    assert [s.status for s in batch] == [Status.PENDING, Status.FAILED, Status.PENDING]
    assert batch[1].metadata["reward_error"] == "ValueError: cannot grade 1"
    assert "reward_error" not in batch[0].metadata
    with pytest.raises(ValueError, match="cannot grade 1"):  # the raising variant
        asyncio.run(compute_reward(args(custom_rm_path=f"{mod}.rm"), batch[1]))


def test_bad_return_values_fail_the_sample(make_module):
    mod = make_module("""
        async def rm(args, sample):
            return {"none": None, "nan": float("nan"), "text": "1.0"}[sample.response]
    """)
    batch = samples(("none", None), ("nan", None), ("text", None))
    asyncio.run(reward_samples(args(custom_rm_path=f"{mod}.rm"), batch))
    assert all(s.status is Status.FAILED and s.reward is None for s in batch)
    assert batch[0].metadata["reward_error"].startswith("DataFormatError: ")
    assert "returned NaN" in batch[1].metadata["reward_error"]
    assert "returned str '1.0'" in batch[2].metadata["reward_error"]


def test_unknown_metadata_rm_type_fails_that_sample_with_suggestion():
    batch = samples(("\\boxed{19}", "19"), ("19", "19"))
    batch[1].metadata["rm_type"] = "maht"
    asyncio.run(reward_samples(args(rm_type="math"), batch))
    assert batch[0].reward == 1.0
    assert batch[1].status is Status.FAILED
    assert batch[1].metadata["reward_error"].startswith("RewardTypeError: metadata.rm_type: unknown reward "
                                                        "type 'maht'; did you mean 'math'?")


def test_no_reward_configured_fails_with_hint():
    with pytest.raises(RewardTypeError, match="set rm_type"):
        asyncio.run(compute_reward(args(), Sample(response="1", label="1")))


def test_dict_reward_with_reward_key():
    batch = samples(("Answer: 42", "42"), ("Answer: 41", "42"))
    asyncio.run(reward_samples(args(rm_type="dapo", reward_key="score"), batch))
    assert batch[0].reward == {"score": 1.0, "acc": True, "pred": "42"}
    assert batch[1].reward == {"score": -1.0, "acc": False, "pred": "41"}
    assert [s.get_reward_value(args(reward_key="score")) for s in batch] == [1.0, -1.0]


def test_dict_reward_without_usable_key_fails():
    no_key = samples(("Answer: 42", "42"))
    asyncio.run(reward_samples(args(rm_type="dapo"), no_key))
    assert no_key[0].status is Status.FAILED and "set reward_key" in no_key[0].metadata["reward_error"]
    wrong_key = samples(("Answer: 42", "42"))
    asyncio.run(reward_samples(args(rm_type="dapo", reward_key="acc_x"), wrong_key))
    assert "reward_key 'acc_x'" in wrong_key[0].metadata["reward_error"]


def test_group_rm_scores_the_list_in_one_call(make_module):
    mod = make_module("""
        CALLS = []
        async def rm(args, samples):
            CALLS.append([s.index for s in samples])
            best = max(len(s.response) for s in samples)
            return [1.0 if len(s.response) == best else 0.0 for s in samples]
    """)
    batch = samples(("a", None), ("abc", None), ("ab", None))
    asyncio.run(reward_samples(args(custom_rm_path=f"{mod}.rm", group_rm=True), batch))
    assert [s.reward for s in batch] == [0.0, 1.0, 0.0]
    assert __import__(mod).CALLS == [[0, 1, 2]]


def test_group_rm_failure_or_wrong_length_fails_every_sample(make_module):
    mod = make_module("""
        async def short(args, samples):
            return [1.0]
        async def boom(args, samples):
            raise RuntimeError("judge down")
    """)
    batch = samples(("a", None), ("b", None))
    asyncio.run(reward_samples(args(custom_rm_path=f"{mod}.short", group_rm=True), batch))
    assert all(s.status is Status.FAILED for s in batch)
    assert batch[0].metadata["reward_error"] == (
        f"DataFormatError: group reward {mod}.short returned 1 rewards for 2 samples; "
        "expected a list with one reward per sample")
    batch = samples(("a", None), ("b", None))
    asyncio.run(reward_samples(args(custom_rm_path=f"{mod}.boom", group_rm=True), batch))
    assert [s.metadata["reward_error"] for s in batch] == ["RuntimeError: judge down"] * 2


def test_group_rm_without_custom_path_scores_each_sample():
    batch = samples(("19", "19"), ("3", "19"))
    asyncio.run(reward_samples(args(rm_type="math_verify", group_rm=True), batch))
    assert [s.reward for s in batch] == [1.0, 0.0]


# ----------------------------------------------------------------------------- set-up checks


def test_check_accepts_known_types_and_the_config_object():
    for rm_type in ("math", "math_verify", "boxed_math", "dapo", "deepscaler", "f1", "gpqa", "random"):
        check_reward_config(args(rm_type=rm_type))
    check_reward_config(load_config(overrides=["--rm-type", "math"]))


def test_check_unknown_rm_type_suggests():
    with pytest.raises(RewardTypeError, match=r"unknown reward type 'deepscalar'; did you mean 'deepscaler'\?"):
        check_reward_config(args(rm_type="deepscalar"))
    with pytest.raises(RewardTypeError, match="did you mean 'boxed_math'"):
        check_reward_config(args(rm_type="boxed_mat"))


def test_check_remote_rm_needs_url():
    with pytest.raises(ConfigError, match="remote_rm needs rm_url"):
        check_reward_config(load_config(overrides=["--rm-type", "remote_rm"]))
    check_reward_config(args(rm_type="remote_rm", rm_url="http://127.0.0.1:1/score"))


def test_check_custom_rm_path_errors(make_module):
    mod = make_module("""
        async def good(args, sample):
            return 1.0
        def not_async(args, sample):
            return 1.0
        async def one_arg(sample):
            return 1.0
        async def group(args, samples):
            return [1.0 for _ in samples]
    """)
    check_reward_config(args(custom_rm_path=f"{mod}.good"))
    check_reward_config(args(custom_rm_path=f"{mod}.group", group_rm=True))
    with pytest.raises(PluginError, match="must be an `async def` function"):
        check_reward_config(args(custom_rm_path=f"{mod}.not_async"))
    with pytest.raises(PluginError, match=r"has signature \(sample\) but is called as fn\(args, sample\)"):
        check_reward_config(args(custom_rm_path=f"{mod}.one_arg"))
    with pytest.raises(PluginError, match="has no attribute 'god'; did you mean good"):
        check_reward_config(args(custom_rm_path=f"{mod}.god"))
    with pytest.raises(PluginError, match="cannot import module 'no_such_mod_xyz'"):
        check_reward_config(args(custom_rm_path="no_such_mod_xyz.rm"))


def test_custom_path_that_fails_to_load_at_run_time_fails_samples_not_the_call():
    batch = samples(("a", None))
    asyncio.run(reward_samples(args(custom_rm_path="no_such_mod_xyz.rm"), batch))
    assert batch[0].status is Status.FAILED
    assert batch[0].metadata["reward_error"].startswith("PluginError: plugin 'no_such_mod_xyz.rm': cannot import")



def test_rule_rewards_grade_off_the_event_loop(monkeypatch):
    """A slow grader must not stall the loop that streams the rollout's other requests: while four answers
    are graded (0.3 s each), a ticker on the same loop keeps running, and the four overlap."""
    from slime.rollout.rewards import hub

    def slow_math(response, label, metadata):
        time.sleep(0.3)
        return 1.0

    monkeypatch.setitem(hub.RULE_REWARDS, "math", slow_math)
    ticks = []

    async def run():
        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        tick = asyncio.create_task(ticker())
        started = time.monotonic()
        await reward_samples(args(rm_type="math"), samples(*[("1", "1")] * 4))
        tick.cancel()
        return time.monotonic() - started

    elapsed = asyncio.run(run())
    assert elapsed < 1.0  # 4 x 0.3 s in sequence would be 1.2 s
    assert len(ticks) >= 8 and max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) < 0.2


def test_the_config_sizes_the_grading_pool(monkeypatch):
    from slime.rollout.rewards import grading_process

    monkeypatch.setattr(grading_process, "_max_processes", grading_process._max_processes)
    check_reward_config(args(rm_type="math", grading_processes=3))
    assert grading_process._max_processes == 3
    check_reward_config(args(rm_type="math", grading_processes=None))
    assert grading_process._max_processes == grading_process.default_max_processes()
