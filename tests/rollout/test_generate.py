"""`sample_seed`: the per-sample `sampling_seed` that makes a resumed rollout draw what an uninterrupted
one drew (end to end: tests/rl/test_sigkill_resume.py); `rollout_max_context_len`: what each request asks
for and when none is sent (end to end: tests/rollout/test_context_len.py)."""

import asyncio
from types import SimpleNamespace

import pytest

from slime.engines.client import EngineClient
from slime.rollout.generate import generate, sample_seed
from slime.rollout.hooks import RolloutPlugins
from slime.rollout.multiturn import (
    append_env_tokens,
    append_model_output,
    append_tokens,
    budget_left,
    generate_turn,
    response_limit,
)
from slime.rollout.state import GenerateState
from slime.types import Sample, Status


def sample(group_index: int, index: int, response_length: int = 0) -> Sample:
    return Sample(prompt="1+1=", group_index=group_index, index=index, response_length=response_length)


def test_a_seed_depends_on_the_rollout_seed_and_the_sample_ids_only():
    args = SimpleNamespace(rollout_seed=42)
    seeds = [sample_seed(args, sample(g, g * 4 + i)) for g in range(3) for i in range(4)]
    assert len(set(seeds)) == 12 and all(0 <= s < 2**63 for s in seeds)  # SGLang keeps it in an int64
    assert seeds == [sample_seed(SimpleNamespace(rollout_seed=42), sample(g, g * 4 + i))  # another process, rerun
                     for g in range(3) for i in range(4)]
    assert sample_seed(SimpleNamespace(rollout_seed=43), sample(0, 0)) != seeds[0]
    assert sample_seed(args, sample(0, 0), evaluation=True) != seeds[0]  # eval sample 0 is not rollout sample 0
    assert sample_seed(args, sample(0, 0, response_length=3)) != seeds[0]  # a continued partial sample
    assert sample_seed(args, Sample(prompt="x")) is None  # no ids: the engine picks


# ----------------------------------------------------------------------------- rollout_max_context_len
# A stand-in for the router: records each /generate body and answers with as many tokens as it may.


class RecordingRouter:
    """Replaces `EngineClient.post`: records the `/generate` payloads, answers each with `max_new_tokens`
    tokens (finish_reason length) or `reply_tokens` of them (stop), whichever is fewer."""

    def __init__(self, reply_tokens: int = 1000) -> None:
        self.payloads: list[dict] = []
        self.reply_tokens = reply_tokens

    async def post(self, url: str, json=None):  # bound to the recorder: no EngineClient self
        assert url.endswith("/generate"), url
        self.payloads.append(json)
        n = min(json["sampling_params"].get("max_new_tokens", self.reply_tokens), self.reply_tokens)
        reason = "length" if n < self.reply_tokens else "stop"
        return {"text": "x" * n, "meta_info": {"output_token_logprobs": [[-0.5, 7, None]] * n,
                                               "finish_reason": {"type": reason}, "weight_version": "1"}}


@pytest.fixture
def router(monkeypatch):
    fake = RecordingRouter()
    monkeypatch.setattr(EngineClient, "post", fake.post)
    return fake


def ctx_args(context: int | None, **fields) -> SimpleNamespace:
    return SimpleNamespace(rollout_max_context_len=context, sglang_router_ip="127.0.0.1", sglang_router_port=1,
                           rollout_seed=1, **fields)


def prompt_sample(prompt_len: int, index: int = 0) -> Sample:
    return Sample(prompt="p", index=index, group_index=index, tokens=list(range(1, prompt_len + 1)))


def test_response_limit_is_the_tighter_of_max_new_tokens_and_the_context_left():
    params = {"max_new_tokens": 50}
    assert response_limit(ctx_args(None), prompt_sample(30), params) == 50
    assert response_limit(ctx_args(100), prompt_sample(30), params) == 50
    assert response_limit(ctx_args(70), prompt_sample(30), params) == 40  # 70 - 30
    assert response_limit(ctx_args(70), prompt_sample(30), {}) == 40  # no max_new_tokens: the context alone
    assert response_limit(None, prompt_sample(30), {}) is None
    resumed = prompt_sample(30)
    append_tokens(resumed, [9] * 12, log_probs=[-1.0] * 12, trainable=True)  # 12 response tokens so far
    assert response_limit(ctx_args(70), resumed, params) == 40  # the prompt is 42 - 12 tokens
    assert budget_left(resumed, params, ctx_args(70)) == 28 and resumed.status is Status.PENDING
    assert budget_left(resumed, params) == 38  # without args: max_new_tokens alone, as before


def test_a_request_asks_for_no_more_than_the_context_leaves(router):
    args = ctx_args(64)
    sample = asyncio.run(generate(args, prompt_sample(40), {"max_new_tokens": 100, "temperature": 1.0}))
    assert [p["sampling_params"]["max_new_tokens"] for p in router.payloads] == [24]
    assert router.payloads[0]["input_ids"] == list(range(1, 41))
    assert sample.response_length == 24 and len(sample.tokens) == 64 and sample.status is Status.TRUNCATED
    # a looser context leaves max_new_tokens as it was
    asyncio.run(generate(ctx_args(1000), prompt_sample(40), {"max_new_tokens": 100}))
    assert router.payloads[1]["sampling_params"]["max_new_tokens"] == 100


@pytest.mark.parametrize("prompt_len", [64, 80])
def test_a_prompt_that_fills_the_context_is_truncated_without_a_request(router, prompt_len):
    sample = asyncio.run(generate(ctx_args(64), prompt_sample(prompt_len), {"max_new_tokens": 100}))
    assert router.payloads == []
    assert sample.status is Status.TRUNCATED and sample.response_length == 0
    assert sample.tokens == list(range(1, prompt_len + 1))


def test_multi_turn_keeps_the_whole_context_within_the_bound(router):
    """Each turn asks for what the context has left after the prompt, earlier turns and tool replies."""
    args, params = ctx_args(60), {"max_new_tokens": 100}
    sample = prompt_sample(20)

    async def episode():
        while budget_left(sample, params, args):
            append_model_output(args, sample, await generate_turn(args, sample, params, max_new_tokens=8))
            if budget_left(sample, params, args) > 5:
                append_env_tokens(sample, [3] * 5)
                sample.status = Status.PENDING
        with pytest.raises(ValueError, match="no tokens left for another model turn"):
            await generate_turn(args, sample, params)  # a plugin that did not check budget_left

    asyncio.run(episode())
    asked = [p["sampling_params"]["max_new_tokens"] for p in router.payloads]
    assert asked == [8, 8, 8, 1]  # 20 + (8 + 5) * 3 = 59: one token of room left, not the turn's 8
    assert [len(p["input_ids"]) for p in router.payloads] == [20, 33, 46, 59]
    assert len(sample.tokens) == 60 and sample.status is Status.TRUNCATED
    sample.validate()


def test_a_custom_generate_function_past_the_context_is_cut_to_it():
    async def too_long(args, sample, sampling_params):  # ignores every budget
        sample.tokens = list(range(1, 31))
        append_tokens(sample, [5] * 50, log_probs=[-1.0] * 50, trainable=True)
        return sample

    args = ctx_args(40, sglang_server_concurrency=1)
    plugins = RolloutPlugins(generate=too_long, dynamic_filter=None, sample_filter=None, all_samples_process=None)
    state = GenerateState(args, plugins, 1)
    sample = asyncio.run(state.generate_sample(Sample(prompt="p", index=0, group_index=0), {"max_new_tokens": 100}))
    assert sample.response_length == 10 and len(sample.tokens) == 40 and sample.status is Status.TRUNCATED
    sample.validate()
