import json

import pytest

from slime.data.sft import load_sft_samples
from slime.data.tiny import build_tokenizer
from slime.errors import DataFormatError


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_multi_turn_mask_covers_only_assistant_tokens(tmp_path, tokenizer):
    path = tmp_path / "sft.jsonl"
    chat = [{"role": "system", "content": "math"}, {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"}]
    path.write_text(json.dumps({"messages": chat}) + "\n")
    [sample] = load_sft_samples(str(path), tokenizer)
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    assert len(sample.loss_mask) == sample.response_length
    # the response starts at the first assistant token; only assistant tokens are trained
    trained = tokenizer.decode([t for t, m in zip(response, sample.loss_mask, strict=True) if m])
    assert trained == "2<|im_end|>4<|im_end|>"
    assert sample.loss_mask[0] == 1 and 0 in sample.loss_mask  # the second user turn is masked out
    prompt = tokenizer.decode(sample.tokens[: len(sample.tokens) - sample.response_length])
    assert prompt.endswith("<|im_start|>assistant\n") and "1+1=" in prompt


def test_bad_conversations_name_the_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: no assistant tokens"):
        load_sft_samples(str(path), tokenizer)
    path.write_text(json.dumps({"conversation": []}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:1: field 'messages' .*fields present: \['conversation'\]"):
        load_sft_samples(str(path), tokenizer)
    path.write_text(json.dumps(good) + "\n")
    with pytest.raises(DataFormatError, match="more than 5"):
        load_sft_samples(str(path), tokenizer, max_length=5)
