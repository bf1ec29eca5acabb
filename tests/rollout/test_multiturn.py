"""Multi-turn helpers (model tokens train, environment tokens do not) and the calculator-tool example run
end to end through the router and two built-in engines."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from examples.calculator_tool import REMINDER, run_tool_calls, tool_message
from slime.data.prompts import load_prompts
from slime.data.source import RolloutDataSource
from slime.rollout import generate_rollout
from slime.rollout.multiturn import append_env_tokens, append_model_output, append_tokens
from slime.types import Sample, Status


def engine_output(tokens, log_probs, reason="length", version="3"):
    return {"text": "t" * len(tokens), "output_ids": tokens, "meta_info": {
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(log_probs, tokens, strict=True)],
        "finish_reason": {"type": reason}, "weight_version": version}}


def test_model_and_env_turns_keep_every_list_aligned():
    sample = Sample(index=0, prompt="1+1=", tokens=[5, 6, 7])
    append_model_output(None, sample, engine_output([10, 11], [-0.5, -0.25]))
    append_env_tokens(sample, [20, 21, 22], text="<tool>")
    append_model_output(None, sample, engine_output([12], [-1.0], reason="stop", version="4"))
    sample.validate()
    assert sample.tokens == [5, 6, 7, 10, 11, 20, 21, 22, 12]
    assert sample.response_length == 6
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert sample.response == "tt<tool>t"
    assert sample.status is Status.COMPLETED and sample.weight_versions == ["3", "4"]


def test_append_rejects_inconsistent_input():
    sample = Sample(index=0, tokens=[1])
    with pytest.raises(ValueError, match="need the engine's log-probs"):
        append_tokens(sample, [2], log_probs=None, trainable=True)
    with pytest.raises(ValueError, match="2 log-probs for 1 tokens"):
        append_tokens(sample, [2], log_probs=[0.0, 0.0], trainable=True)
    legacy = Sample(index=1, tokens=[1, 2], response_length=1)  # a response without log-probs
    with pytest.raises(ValueError, match="no rollout_log_probs"):
        append_tokens(legacy, [3], log_probs=[-1.0], trainable=True)


def test_calculator_tool_calls_are_parsed_and_evaluated_safely():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "12+34*2"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>not json</tool_call>')
    results = run_tool_calls(text)
    assert results[0]["result"] == 80
    assert results[1]["error"].startswith("ValueError: unsupported expression element")
    assert results[2]["error"] == "ValueError: unknown tool 'search'"
    assert results[3]["error"].startswith("JSONDecodeError")
    assert tool_message(results[:1]) == "<|im_end|>\n<|im_start|>tool\n80<|im_end|>\n<|im_start|>assistant\n"
    assert REMINDER in tool_message([])


@pytest.mark.parametrize("max_response_len", [120, None])  # None: no response limit, the turns bound it
def test_calculator_example_runs_through_the_router(make_args, tiny_kit, max_response_len):
    args = make_args(rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=max_response_len,
                     custom_generate_function_path="examples.calculator_tool.generate",
                     custom_rm_path="rollout_plugins.rm_one")
    data_source = RolloutDataSource(load_prompts(str(tiny_kit.train)), n_samples_per_prompt=2, args=args)
    out = generate_rollout(args, 0, data_source)
    tokenizer = AutoTokenizer.from_pretrained(tiny_kit.model_dir)
    assert len(out.samples) == 2
    for sample in (s for g in out.samples for s in g):
        sample.validate()
        assert sample.reward == 1.0 and sample.status in (Status.COMPLETED, Status.TRUNCATED)
        response = sample.tokens[len(sample.tokens) - sample.response_length:]
        mask = sample.loss_mask
        # split the response into runs of equal mask: model turns (1) alternate with tool replies (0)
        runs, start = [], 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                runs.append((mask[start], response[start:i], sample.rollout_log_probs[start:i]))
                start = i
        model_runs = [r for r in runs if r[0] == 1]
        env_runs = [r for r in runs if r[0] == 0]
        assert runs[0][0] == 1 and len(model_runs) == sample.metadata["turns"] >= 2
        assert len(env_runs) == len(model_runs) - 1
        for _, tokens, log_probs in model_runs:
            assert 1 <= len(tokens) <= 8 and all(lp <= 0 for lp in log_probs)
        for (_, tokens, log_probs), calls in zip(env_runs, [sample.metadata["tool_calls"]] * len(env_runs),
                                                 strict=True):
            assert all(lp == 0.0 for lp in log_probs)
            text = tokenizer.decode(tokens)
            assert text.startswith("<|im_end|>\n<|im_start|>tool\n") and text.endswith("<|im_start|>assistant\n")
            assert REMINDER in text or calls  # a reminder unless the model called the tool
        # the prompt was rendered with the tool schema by the chat template
        prompt = tokenizer.decode(sample.tokens[: len(sample.tokens) - sample.response_length])
        assert '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>assistant\n")
        assert sample.weight_versions == ["default"] * sample.metadata["turns"]
