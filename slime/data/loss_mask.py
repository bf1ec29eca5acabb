"""slime's multi-turn loss masks by chat-template family (`--loss-mask-type`), for templates without
`{% generation %}` blocks (Qwen's own): the conversation is rendered one message at a time and the tokens
each assistant message adds after its generation prompt are trained on.

The rules are slime's `MultiTurnLossMaskGenerator` (`slime/utils/mask_utils.py`):

* `qwen`: each message rendered alone; every message after the first loses the system prompt the template
  puts in front of it (its length is measured once from two rendered user turns), and an assistant message's
  first `gen_token_length` tokens (the generation prompt, `<|im_start|>assistant\\n`) are not trained on;
  a tokenizer with DeepSeek-distill's `<｜Assistant｜>` token uses `distill_qwen`.
* `qwen3`: as `qwen`, with each message rendered beside a fixed prefix message that is cut off again (Qwen3's
  template renders a message differently when it comes first), consecutive tool messages together.
* `distill_qwen`: the first message with the generation prompt, then the last message's content, trained on.

A message with `step_loss_mask` other than 1 is not trained on. `qwen3_5` (offset mapping over the whole
rendered text) is not built here: config validation refuses it.
"""

from __future__ import annotations

from typing import Any

from slime.errors import DataFormatError

LOSS_MASK_TYPES = ("qwen", "qwen3", "distill_qwen")
_PROBE = "FOR TESTING ONLY"
_PREFIX = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}


def _ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def _sublist_starts(main: list[int], sub: list[int]) -> list[int]:
    return [i for i in range(len(main) - len(sub) + 1) if main[i:i + len(sub)] == sub]


def template_lengths(tokenizer: Any) -> tuple[int, int]:
    """(system prompt tokens the template puts before a lone message, generation-prompt tokens)."""
    probe = [{"role": "user", "content": _PROBE}] * 2
    raw = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    rendered = tokenizer(tokenizer.apply_chat_template(probe, tokenize=False), add_special_tokens=False)["input_ids"]
    starts = _sublist_starts(rendered, raw)
    if len(starts) != 2:
        raise DataFormatError(f"loss_mask_type: the chat template does not render two user turns as slime's qwen "
                              f"rules expect (found the probe text {len(starts)} times)")
    first, second = starts
    tail = len(rendered) - len(raw) - second
    generation = len(_ids(tokenizer, probe, add_generation_prompt=True)) - len(rendered)
    return first - ((second - first) - tail - len(raw)), generation


def multi_turn_loss_mask(tokenizer: Any, messages: list[dict[str, Any]], kind: str,
                         tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation under slime's `kind` rules (see the module docstring)."""
    if kind == "qwen" and "<｜Assistant｜>" in tokenizer.get_added_vocab():
        kind = "distill_qwen"
    if kind == "distill_qwen":
        prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, tools=tools)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        trained = messages[-1].get("step_loss_mask", 1) == 1
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [int(trained)] * len(response_ids)
    if kind not in LOSS_MASK_TYPES:
        raise DataFormatError(f"loss_mask_type {kind!r}: one of {', '.join(LOSS_MASK_TYPES)}")
    system_length, generation_length = template_lengths(tokenizer)
    prefix = _ids(tokenizer, [_PREFIX]) if kind == "qwen3" else []
    ids: list[int] = []
    mask: list[int] = []
    i = 0
    while i < len(messages):
        end = i + 1
        if kind == "qwen3" and messages[i]["role"] == "tool":  # Qwen wraps consecutive tool turns in one
            while end < len(messages) and messages[end]["role"] == "tool":
                end += 1
        group, message = messages[i:end], messages[i]
        if kind == "qwen":
            part = _ids(tokenizer, group, **({"tools": tools} if i == 0 else {}))
        elif i == 0:
            part = _ids(tokenizer, group + [_PREFIX], tools=tools)[:-len(prefix)]
        else:
            part = _ids(tokenizer, [_PREFIX] + group)[len(prefix):]
        if message["role"] != "system" and i > 0:
            part = part[system_length:]
        if message["role"] == "assistant" and message.get("step_loss_mask", 1) == 1:
            part_mask = [0] * generation_length + [1] * (len(part) - generation_length)
        else:
            part_mask = [0] * len(part)
        ids += part
        mask += part_mask
        i = end
    return ids, mask
