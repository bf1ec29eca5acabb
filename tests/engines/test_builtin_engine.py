"""The built-in engine in process: continuous batching, log-prob exactness, sampling controls."""

import asyncio

import pytest
import torch

from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.engines.builtin.sampling import BadRequestError, SamplingParams


@pytest.fixture(scope="module", params=["dynamic", "slots"])
def engine(tiny_kit, request):
    # both KV-cache paths: the dynamic cache (CPU default) and the slot cache (CUDA default, eager here)
    eng = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), random_seed=7, kv_cache=request.param))
    assert eng.scheduler.kv_cache == request.param
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(coro)


def teacher_forced_logprobs(engine, prompt, output_ids, temperature=1.0):
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0].float() / temperature
    steps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return steps.gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1)


def test_concurrent_requests_match_teacher_forced_logprobs(engine):
    tok = engine.tokenizer
    prompts = [tok.encode(f"{i}+{i * 37}=") for i in range(1, 7)] + [tok.encode("a much longer prompt: 1234+5678=")]

    async def go():
        # different lengths and budgets: rows join and leave the batch at different steps
        return await asyncio.gather(*[
            engine.generate({"input_ids": p, "return_logprob": True,
                             "sampling_params": {"max_new_tokens": 10 + 5 * i, "temperature": 0.8,
                                                 "ignore_eos": True}})
            for i, p in enumerate(prompts)])

    steps_before = engine.scheduler.steps
    outs = run(go())
    # batched: far fewer steps than the sum of all tokens generated
    assert engine.scheduler.steps - steps_before < sum(10 + 5 * i for i in range(len(prompts)))
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        meta = out["meta_info"]
        assert meta["completion_tokens"] == len(out["output_ids"]) == 10 + 5 * i
        assert meta["finish_reason"] == {"type": "length", "length": 10 + 5 * i}
        assert meta["prompt_tokens"] == len(prompt)
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        engine_lp = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        ref = teacher_forced_logprobs(engine, prompt, out["output_ids"], temperature=0.8)
        assert (engine_lp - ref).abs().max().item() < 1e-5


def test_requests_joining_and_leaving_a_running_batch_keep_exact_logprobs(engine):
    tok = engine.tokenizer

    async def go():
        first = [asyncio.ensure_future(engine.generate({
            "input_ids": tok.encode(f"{i}*{i}="), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4 + 12 * i, "ignore_eos": True}})) for i in range(3)]
        while engine.scheduler.steps < 3:  # the first rows are decoding (and the shortest has left)
            await asyncio.sleep(0.005)
        late = [engine.generate({"input_ids": tok.encode(f"late {i}: 99+{i}="), "return_logprob": True,
                                 "sampling_params": {"max_new_tokens": 9, "ignore_eos": True}}) for i in range(2)]
        return await asyncio.gather(*first, *late)

    outs = run(go())
    prompts = [tok.encode(f"{i}*{i}=") for i in range(3)] + [tok.encode(f"late {i}: 99+{i}=") for i in range(2)]
    for prompt, out in zip(prompts, outs, strict=True):
        engine_lp = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert (engine_lp - teacher_forced_logprobs(engine, prompt, out["output_ids"])).abs().max().item() < 1e-5


def test_seeded_sampling_is_deterministic_and_batch_independent(engine):
    tok = engine.tokenizer
    body = {"input_ids": tok.encode("12+34="), "sampling_params": {"max_new_tokens": 12, "sampling_seed": 42,
                                                                     "ignore_eos": True}}
    alone = run(engine.generate(body))["output_ids"]

    async def crowded():
        noise = [engine.generate({"input_ids": tok.encode(f"{i}-1="), "sampling_params": {"max_new_tokens": 20}})
                 for i in range(5)]
        results = await asyncio.gather(engine.generate(body), *noise)
        return results[0]["output_ids"]

    assert run(crowded()) == alone
    other = run(engine.generate({**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 43}}))
    assert other["output_ids"] != alone


def test_greedy_equals_argmax_and_top_k_one(engine):
    prompt = engine.tokenizer.encode("7+8=")
    greedy = run(engine.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                            "ignore_eos": True}}))
    top1 = run(engine.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "top_k": 1,
                                                                          "ignore_eos": True}}))
    assert greedy["output_ids"] == top1["output_ids"]
    with torch.no_grad():
        first = int(engine.model(torch.tensor([prompt])).logits[0, -1].argmax())
    assert greedy["output_ids"][0] == first


def test_top_p_restricts_to_the_nucleus(engine):
    prompt = engine.tokenizer.encode("99-9=")
    with torch.no_grad():
        probs = torch.softmax(engine.model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    top = probs.argsort(descending=True)
    nucleus = set(top[: int((probs[top].cumsum(0) < 0.3).sum()) + 1].tolist())

    async def draws():
        return await asyncio.gather(*[engine.generate({"input_ids": prompt, "return_logprob": True,
                                                       "sampling_params": {"max_new_tokens": 1, "top_p": 0.3}})
                                      for _ in range(12)])

    for out in run(draws()):
        token = out["output_ids"][0]
        assert token in nucleus
        # log-prob under the renormalised nucleus, not the full distribution
        expected = torch.log(probs[token] / probs[list(nucleus)].sum()).item()
        assert abs(out["meta_info"]["output_token_logprobs"][0][0] - expected) < 1e-5


def test_stop_token_stop_string_and_min_new_tokens(engine):
    tok = engine.tokenizer
    prompt = tok.encode("1+1=")
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    free = run(engine.generate({"input_ids": prompt, "sampling_params": greedy}))["output_ids"]
    stop_id = free[2]
    out = run(engine.generate({"input_ids": prompt, "sampling_params": {**greedy, "stop_token_ids": [stop_id]}}))
    assert out["output_ids"] == free[: free.index(stop_id) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}

    stop_text = tok.decode(free[3:5])
    out = run(engine.generate({"input_ids": prompt, "sampling_params": {**greedy, "stop": stop_text}}))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert stop_text not in out["text"]
    kept = run(engine.generate({"input_ids": prompt,
                                "sampling_params": {**greedy, "stop": stop_text, "no_stop_trim": True}}))
    assert kept["text"].endswith(stop_text)

    banned = run(engine.generate({"input_ids": prompt, "sampling_params": {
        **greedy, "stop_token_ids": [free[0]], "min_new_tokens": 3}}))
    assert free[0] not in banned["output_ids"][:3]


def test_prompt_scoring_gives_input_logprobs(engine):
    prompt = engine.tokenizer.encode("31+11=42")
    out = run(engine.generate({"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                               "sampling_params": {"max_new_tokens": 0}}))
    assert out["output_ids"] == []
    scored = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in scored] == prompt and scored[0][0] is None
    ref = teacher_forced_logprobs(engine, prompt[:1], prompt[1:])
    assert max(abs(a[0] - b) for a, b in zip(scored[1:], ref.tolist(), strict=True)) < 1e-5


def test_batched_body_and_text_input(engine):
    tok = engine.tokenizer
    outs = run(engine.generate({"text": ["1+2=", "3+4="], "rid": ["a", "b"],
                                "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True},
                                                    {"max_new_tokens": 3, "ignore_eos": True}]}))
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 3]
    assert outs[0]["meta_info"]["prompt_tokens"] == len(tok.encode("1+2="))


@pytest.mark.parametrize(("body", "message"), [
    ({"input_ids": []}, "input is empty"),
    ({"input_ids": [1, 2], "text": "x"}, "exactly one of"),
    ({"input_ids": [10**9]}, "outside the vocabulary"),
    ({"input_ids": "not ids"}, "list of integers"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens=-1"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "not supported"),
    ({"input_ids": [1], "sampling_params": {"temprature": 1.0}}, "unknown sampling_params field 'temprature'"),
    ({"input_ids": [1], "stream": True}, "'stream'=True is not supported"),
    ({"input_ids": [1], "top_logprobs_num": 5}, "'top_logprobs_num'=5 is not supported"),
    ({"input_ids": [[1], [2]], "rid": ["only-one"]}, "rid is a list of 1 but there are 2 inputs"),
])
def test_bad_requests_are_refused(engine, body, message):
    with pytest.raises(BadRequestError, match=message):
        run(engine.generate(body))


def test_fields_added_by_the_router_are_accepted(engine):
    # sglang-router re-serialises bodies and adds these; SGLang ignores them, so must we
    out = run(engine.generate({"input_ids": [49], "model": "tiny", "stream": False, "return_bytes": False,
                               "return_entropy": False, "sampling_params": {"max_new_tokens": 1}}))
    assert out["meta_info"]["completion_tokens"] == 1


def test_sampling_params_defaults_match_sglang():
    params = SamplingParams.from_request({"stop": "\n"})
    assert params.stop == ["\n"] and params.temperature == 1.0 and params.top_k == -1
    assert params.skip_special_tokens is True and params.no_stop_trim is False
