"""`rollout_max_context_len` / `eval_max_context_len` end to end through the router and two built-in engines:
each request asks for at most the context left after its prompt, a prompt that fills the context is
TRUNCATED without a request, and eval samples obey the eval bound. The requests are counted on the
rollout's own HTTP client (a spy that forwards every call to the engines)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from slime.data.prompts import load_prompts
from slime.data.source import RolloutDataSource
from slime.engines.client import EngineClient
from slime.rollout import generate_rollout
from slime.rollout.eval import EvalDatasetConfig, dataset_args
from slime.types import Sample, Status


@pytest.fixture
def generate_requests(monkeypatch):
    """The `/generate` payloads the rollout sends, in order (each still goes to the router)."""
    payloads: list[dict] = []
    post = EngineClient.post

    async def spy(self, url, json=None):
        if url.endswith("/generate"):
            payloads.append(json)
        return await post(self, url, json)

    monkeypatch.setattr(EngineClient, "post", spy)
    return payloads


@pytest.fixture
def prompts(tiny_kit):
    """A short prompt and a long one (the short one four times), with their token counts."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_kit.model_dir)
    short = load_prompts(str(tiny_kit.train))[0]
    long = Sample(index=1, group_index=1, prompt=short.prompt * 4, label=short.label, metadata={})
    count = lambda s: len(tokenizer.encode(s.prompt, add_special_tokens=False))  # noqa: E731
    return SimpleNamespace(short=short, long=long, short_len=count(short), long_len=count(long))


def test_rollout_requests_are_bounded_by_the_context(make_args, prompts, generate_requests):
    context = prompts.short_len + 3  # 3 tokens of room after the short prompt; the long one does not fit
    assert prompts.long_len >= context
    args = make_args(rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=6,
                     rollout_max_context_len=context, custom_rm_path="rollout_plugins.rm_one")
    source = RolloutDataSource([prompts.short, prompts.long], n_samples_per_prompt=2, args=args)
    out = generate_rollout(args, 0, source)
    short, long = out.samples
    assert [p["sampling_params"]["max_new_tokens"] for p in generate_requests] == [3, 3]  # not 6
    assert {len(p["input_ids"]) for p in generate_requests} == {prompts.short_len}
    for s in short:
        assert 1 <= s.response_length <= 3 and len(s.tokens) <= context and s.reward == 1.0
        s.validate()
    for s in long:  # no request was sent for them; rewarded as finished samples (slime)
        assert s.status is Status.TRUNCATED and s.response_length == 0 and s.reward == 1.0
        assert len(s.tokens) == prompts.long_len


def test_eval_uses_its_own_context_bound(make_args, prompts, generate_requests, tiny_kit, tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": s.prompt, "label": s.label}) + "\n"
                            for s in (prompts.short, prompts.long)))
    args = make_args(eval_prompt_data={"ctx": str(data)}, n_samples_per_eval_prompt=2, eval_max_response_len=6,
                     rollout_max_context_len=prompts.long_len + 100,  # the rollout's bound would fit both
                     eval_max_context_len=prompts.short_len + 2, custom_rm_path="rollout_plugins.rm_one",
                     run_id="ctxeval", store=str(tmp_path / "store"))
    out = generate_rollout(args, 0, None, evaluation=True)
    short, long = out.data["ctx"]["samples"][:2], out.data["ctx"]["samples"][2:]
    assert [p["sampling_params"]["max_new_tokens"] for p in generate_requests] == [2, 2]
    assert all(1 <= s.response_length <= 2 for s in short)
    assert all(s.status is Status.TRUNCATED and s.response_length == 0 for s in long)
    assert out.metrics["eval/ctx/truncated_ratio"] >= 0.5 and out.metrics["eval/ctx/failed"] == 0


def test_eval_falls_back_to_the_rollout_bound():
    ds = EvalDatasetConfig(name="a", path="x.jsonl")
    assert dataset_args(SimpleNamespace(rollout_max_context_len=50, eval_max_context_len=None),
                        ds).rollout_max_context_len == 50
    args = SimpleNamespace(rollout_max_context_len=50, eval_max_context_len=20)
    assert dataset_args(args, ds).rollout_max_context_len == 20 and args.rollout_max_context_len == 50
