"""slime's --loss-mask-type rules (slime/data/loss_mask.py) on a Qwen2.5-style template: a default system
prompt before every lone message and no {% generation %} blocks, where the template's own marks cannot work."""

import pytest

from slime.config import load_config
from slime.data.loss_mask import multi_turn_loss_mask, template_lengths
from slime.data.sft import conversation_sample
from slime.data.tiny import build_tokenizer
from slime.errors import ConfigError, DataFormatError

QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]


@pytest.fixture
def qwen25():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN25
    return tokenizer


def trained(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_qwen_rules_mask_the_assistant_turns_of_the_whole_render(qwen25):
    system = len(qwen25("<|im_start|>system\nYou are Qwen.<|im_end|>\n", add_special_tokens=False)["input_ids"])
    assert template_lengths(qwen25) == (system, len(qwen25("<|im_start|>assistant\n")["input_ids"]))
    whole = list(qwen25.apply_chat_template(CHAT, tokenize=True, return_dict=False))
    ids, mask = multi_turn_loss_mask(qwen25, CHAT, "qwen")
    assert ids == whole  # the default system prompt appears once, as in the whole render
    assert trained(qwen25, ids, mask) == "4<|im_end|>\n6<|im_end|>\n"  # slime trains the turn's end too
    # qwen3's rules are for Qwen3's templates (no default system prompt): the kit's ChatML template, with tools
    chatml = build_tokenizer()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    chat = [*CHAT[:2], {"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}, *CHAT[2:]]
    ids, mask = multi_turn_loss_mask(chatml, chat, "qwen3", tools)
    assert ids == list(chatml.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=False))
    assert trained(chatml, ids, mask) == "4<|im_end|>\n6<|im_end|>\n"
    skipped = [*CHAT[:3], {**CHAT[3], "step_loss_mask": 0}]
    assert trained(qwen25, *multi_turn_loss_mask(qwen25, skipped, "qwen")) == "4<|im_end|>\n"
    ids, mask = multi_turn_loss_mask(qwen25, CHAT[:2], "distill_qwen")
    assert trained(qwen25, ids, mask) == "4" and qwen25.decode(ids).endswith("<|im_start|>assistant\n4")


def test_sft_samples_take_the_rules_where_the_template_has_no_generation_marks(qwen25):
    with pytest.raises(DataFormatError, match=r"d.jsonl:1: no assistant tokens .* lacks \{% generation %\}"):
        conversation_sample(CHAT, qwen25, index=0, where="d.jsonl:1")
    sample = conversation_sample(CHAT, qwen25, index=0, where="d.jsonl:1", loss_mask_type="qwen")
    assert qwen25.decode(sample.tokens[len(sample.tokens) - sample.response_length:]).startswith("4<|im_end|>")
    assert sum(sample.loss_mask) == len(qwen25("4<|im_end|>\n6<|im_end|>\n")["input_ids"])


def test_qwen3_5_is_refused_with_the_alternatives():
    with pytest.raises(ConfigError, match="--loss-mask-type: sft.loss_mask_type: qwen3_5 .* is not built here: use qwen"):
        load_config(None, ["--loss-mask-type", "qwen3_5"])
    assert load_config(None, ["--loss-mask-type", "qwen3"]).sft.loss_mask_type == "qwen3"
