"""A tool-calling multi-turn generate function: a calculator on the tiny arithmetic task.

Use it with

    --custom-generate-function-path examples.calculator_tool.generate

(run from the repository root, so `examples` is importable). Each sample is a chat with a calculator
tool: the prompt is the user's problem rendered by the chat template with the tool's JSON schema. Then, up
to `MAX_TURNS` times:

1. the model speaks for at most `TURN_TOKENS` tokens, stopping early at `</tool_call>` or `<|im_end|>`
   (model tokens: loss mask 1, the engine's log-probs);
2. the environment answers in a `tool` message (environment tokens: loss mask 0): the calculator's result
   for each `<tool_call>{"name": "calculator", "arguments": {"expression": "12+7"}}</tool_call>` the turn
   made, or, if the turn made none and did not finish, a reminder of how to call the tool.

The episode ends when the model finishes a turn with `<|im_end|>` and no tool call (its final answer),
the response budget (`rollout_max_response_len`; prompt + response within `rollout_max_context_len`) is
used up, the turn limit is reached, or the rollout is aborted. `metadata["turns"]` and
`metadata["tool_calls"]` record what happened; the reward function then grades `sample.response` as usual.
The untrained tiny model rarely emits a well-formed call, so in tests the reminder path runs every time and
the tool path is checked through `run_tool_calls`.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

from slime.rollout.generate import tokenizer_of
from slime.rollout.multiturn import append_env_tokens, append_model_output, budget_left, generate_turn
from slime.types import Sample, Status

MAX_TURNS = 3
TURN_TOKENS = 8
# Kept short: the tiny kit's tokenizer is byte-level and its model's context is 512 tokens.
TOOLS = [{"name": "calculator", "description": "integer + - *",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]
REMINDER = "no tool call; use calculator"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int:
    """Evaluate +, -, * over integers (no names, no calls: safe on model output)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return walk(ast.parse(expression, mode="eval"))


def run_tool_calls(text: str) -> list[dict[str, Any]]:
    """Every `<tool_call>` in `text`, executed: [{"call": raw, "result": int} or {"call": raw, "error": str}]."""
    results = []
    for raw in _CALL.findall(text):
        try:
            call = json.loads(raw)
            if call.get("name") != "calculator":
                raise ValueError(f"unknown tool {call.get('name')!r}")
            results.append({"call": raw, "result": calculate(str(call["arguments"]["expression"]))})
        except (ValueError, KeyError, TypeError, SyntaxError, AttributeError) as exc:
            results.append({"call": raw, "error": f"{type(exc).__name__}: {exc}"})
    return results


def tool_message(results: list[dict[str, Any]]) -> str:
    """The environment's turn as chat-template text: closes the assistant turn, opens the next one."""
    content = "\n".join(json.dumps(r.get("result", r.get("error"))) for r in results) if results else REMINDER
    return f"<|im_end|>\n<|im_start|>tool\n{content}<|im_end|>\n<|im_start|>assistant\n"


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's custom generate signature; see the module docstring."""
    tokenizer = tokenizer_of(args)
    if not sample.tokens:
        messages = [{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str) else sample.prompt
        sample.tokens = list(tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True,
                                                           add_generation_prompt=True, return_dict=False))
    params = {**sampling_params, "stop": ["</tool_call>"]}
    turns = sample.metadata.setdefault("turns", 0)
    calls = sample.metadata.setdefault("tool_calls", [])
    while turns < MAX_TURNS and budget_left(sample, sampling_params, args) != 0:  # None: no limit
        output = await generate_turn(args, sample, params, max_new_tokens=TURN_TOKENS)
        append_model_output(args, sample, output)
        turns += 1
        sample.metadata["turns"] = turns
        reason = output["meta_info"]["finish_reason"]
        if sample.status is Status.ABORTED:
            break
        results = run_tool_calls(output.get("text", ""))
        calls.extend(results)
        final_answer = reason.get("type") == "stop" and not results and reason.get("matched") != "</tool_call>"
        if final_answer or turns == MAX_TURNS:
            break
        env = tokenizer.encode(tool_message(results), add_special_tokens=False)
        left = budget_left(sample, sampling_params, args)
        if left is not None and len(env) >= left:  # no room for another model turn after the tool reply
            sample.status = Status.TRUNCATED
            break
        append_env_tokens(sample, env, text=tool_message(results))
        sample.status = Status.PENDING  # the episode goes on
    if sample.status is Status.PENDING:
        sample.status = Status.COMPLETED
    return sample
