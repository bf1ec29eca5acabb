"""Tests for slime.data.prompts: JSONL/Parquet over fsspec, row slicing, chat templates, strict errors."""

from __future__ import annotations

import gzip
import json
import logging
import re
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slime.data.prompts import load_prompts, parse_data_path, read_records
from slime.errors import ConfigError, DataFormatError
from slime.types import Sample


def write_jsonl(path, rows) -> str:
    """Write rows (dicts are JSON-encoded, strings written verbatim) one per line; return str path."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def numbered(n: int) -> list[dict]:
    return [{"prompt": f"question {i}", "label": str(i)} for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    from slime.data.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def memfs():
    """A unique memory:// folder, removed afterwards so tests do not leak into each other."""
    fs = fsspec.filesystem("memory")
    root = f"/test-prompts-{uuid.uuid4().hex}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


# ---------------------------------------------------------------- parse_data_path


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("data/x.jsonl", ("data/x.jsonl", None)),
        ("data/x.jsonl@[10:20]", ("data/x.jsonl", slice(10, 20))),
        ("x.jsonl@[:5]", ("x.jsonl", slice(None, 5))),
        ("x.parquet@[-3:]", ("x.parquet", slice(-3, None))),
        ("s3://bucket/user@host/x.jsonl", ("s3://bucket/user@host/x.jsonl", None)),
    ],
)
def test_parse_data_path(given, expected):
    assert parse_data_path(given) == expected


@pytest.mark.parametrize("bad", ["x.jsonl@[a:b]", "x.jsonl@[1:2:3]", "x.jsonl@[5]", "x.jsonl@[1:2"])
def test_parse_data_path_rejects_bad_slice(bad):
    with pytest.raises(DataFormatError, match=re.escape(bad)):
        parse_data_path(bad)


# ---------------------------------------------------------------- reading


def test_jsonl_round_trip_slime_format(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(3))
    samples = load_prompts(path)
    assert [s.prompt for s in samples] == ["question 0", "question 1", "question 2"]
    assert [s.label for s in samples] == ["0", "1", "2"]
    assert [(s.index, s.group_index) for s in samples] == [(0, 0), (1, 1), (2, 2)]
    assert all(s.metadata == {} and s.status is Sample.Status.PENDING for s in samples)


def test_read_records_counts_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"a": 1}, "", "   ", {"a": 2}])
    assert list(read_records(path)) == [(1, {"a": 1}), (4, {"a": 2})]


def test_parquet_round_trip(tmp_path):
    table = pa.table(
        {
            "prompt": ["p0", "p1", "p2"],
            "label": [1, 2, 3],
            "metadata": [{"src": "a"}, None, {"src": "c"}],
            "tools": [None, json.dumps([{"name": "calc"}]), None],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    samples = load_prompts(str(tmp_path / "d.parquet"))
    assert [s.prompt for s in samples] == ["p0", "p1", "p2"]
    assert [s.label for s in samples] == [1, 2, 3]
    assert [s.metadata for s in samples] == [{"src": "a"}, {"tools": [{"name": "calc"}]}, {"src": "c"}]
    sliced = list(read_records(f"{tmp_path / 'd.parquet'}@[-2:]"))
    assert [(n, r["prompt"]) for n, r in sliced] == [(2, "p1"), (3, "p2")]


def test_parquet_error_names_row(tmp_path):
    pq.write_table(pa.table({"prompt": ["ok", None], "label": ["a", "b"]}), tmp_path / "d.parquet")
    with pytest.raises(DataFormatError, match=r"d\.parquet:row 2: prompt must be"):
        load_prompts(str(tmp_path / "d.parquet"))


def test_not_a_parquet_file(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataFormatError, match=r"d\.parquet: not a readable Parquet file"):
        load_prompts(str(tmp_path / "d.parquet"))


def test_memory_url_and_file_url(memfs, tmp_path):
    fs, root = memfs
    with fs.open(f"{root}/d.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in numbered(4)))
    samples = load_prompts(f"memory://{root}/d.jsonl@[1:3]")
    assert [s.prompt for s in samples] == ["question 1", "question 2"]
    local = write_jsonl(tmp_path / "d.jsonl", numbered(2))
    assert [s.label for s in load_prompts(f"file://{local}")] == ["0", "1"]


def test_gzip_jsonl(tmp_path):
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in numbered(2)))
    assert [s.prompt for s in load_prompts(str(tmp_path / "d.jsonl.gz"))] == ["question 0", "question 1"]


def test_slicing_keeps_file_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [numbered(1)[0], "", *numbered(4)[1:]])  # records on 1,3,4,5
    assert [n for n, _ in read_records(f"{path}@[1:3]")] == [3, 4]
    assert [n for n, _ in read_records(f"{path}@[-2:]")] == [4, 5]
    samples = load_prompts(f"{path}@[-2:]")
    assert [(s.index, s.prompt) for s in samples] == [(0, "question 2"), (1, "question 3")]


def test_slice_skips_bad_lines_outside_it(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [*numbered(2), "{broken"])
    assert len(load_prompts(f"{path}@[:2]")) == 2


def test_json_extension_is_json_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.json", numbered(2))
    assert len(load_prompts(path)) == 2


# ---------------------------------------------------------------- prompt forms, tools, metadata

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


def test_chat_message_prompt_kept_as_list(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": MESSAGES, "label": "4"}])
    assert load_prompts(path)[0].prompt == MESSAGES


@pytest.mark.parametrize("tools", [[{"name": "calc"}], json.dumps([{"name": "calc"}])])
def test_tools_list_or_json_string_go_to_metadata(tmp_path, tools):
    rec = {"prompt": "x", "label": "y", "metadata": {"source": "gsm8k"}, "tools": tools}
    sample = load_prompts(write_jsonl(tmp_path / "d.jsonl", [rec]))[0]
    assert sample.metadata == {"source": "gsm8k", "tools": [{"name": "calc"}]}


def test_custom_keys_and_no_label(tmp_path):
    rec = {"question": "q", "extra": {"k": 1}}
    sample = load_prompts(
        write_jsonl(tmp_path / "d.jsonl", [rec]), input_key="question", label_key=None, metadata_key="extra"
    )[0]
    assert (sample.prompt, sample.label, sample.metadata) == ("q", None, {"k": 1})


# ---------------------------------------------------------------- chat template and length filter


def test_chat_template_on_string_and_messages(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "What is 2+2?", "label": "4"}, {"prompt": MESSAGES, "label": "4"}]
    )
    first, second = load_prompts(path, tokenizer=tokenizer, apply_chat_template=True)
    for sample, text in ((first, "What is 2+2?"), (second, "2+2?")):
        assert isinstance(sample.prompt, str)
        assert sample.prompt.endswith("<|im_start|>assistant\n")
        assert text in sample.prompt
    assert "<|im_start|>user" in first.prompt
    assert "be brief" in second.prompt


def test_max_prompt_len_drops_and_logs(tmp_path, tokenizer, caplog):
    long_prompt = " ".join(["word"] * 200)
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "short", "label": "a"},
            {"prompt": long_prompt, "label": "b"},
            {"prompt": "tiny", "label": "c"},
        ],
    )
    limit = len(tokenizer.encode("short", add_special_tokens=False)) + 10
    with caplog.at_level(logging.WARNING, logger="slime.data.prompts"):
        samples = load_prompts(path, tokenizer=tokenizer, max_prompt_len=limit)
    assert [(s.index, s.label) for s in samples] == [(0, "a"), (1, "c")]
    assert "dropped 1 of 3" in caplog.text and f"max_prompt_len={limit}" in caplog.text


def test_max_prompt_len_on_templated_text(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "hi", "label": "a"}, {"prompt": "hello", "label": "b"}]
    )
    raw = len(tokenizer.encode("hello", add_special_tokens=False))
    # The raw text fits but the templated prompt (role markers added) does not, for every row.
    with pytest.raises(ConfigError, match="all 2 prompts are longer"):
        load_prompts(path, tokenizer=tokenizer, apply_chat_template=True, max_prompt_len=raw)


def test_max_prompt_len_rejects_untemplated_messages(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": MESSAGES, "label": "4"}])
    with pytest.raises(ConfigError, match=r"d\.jsonl:1: max_prompt_len needs text prompts"):
        load_prompts(path, tokenizer=tokenizer, max_prompt_len=100)


# ---------------------------------------------------------------- errors


def test_malformed_json_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [numbered(1)[0], "", '{"prompt": "x", "label": '])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:3: invalid JSON"):
        load_prompts(path)


def test_non_object_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", "[1, 2]"])
    with pytest.raises(DataFormatError, match=r"d\.jsonl:2: expected a JSON object, got list"):
        load_prompts(path)


def test_missing_input_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [numbered(1)[0], "", {"text": "x", "label": "y"}])
    with pytest.raises(
        DataFormatError,
        match=r"d\.jsonl:3: missing field 'prompt' \(input_key\); "
        r"fields present: \['label', 'text'\]",
    ):
        load_prompts(path)


def test_missing_label_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", {"prompt": "x"}])
    with pytest.raises(DataFormatError, match=r"d\.jsonl:2: missing field 'label' \(label_key\)"):
        load_prompts(path)


@pytest.mark.parametrize(
    ("message", "pattern"),
    [
        ({"content": "hi"}, r"message 1 lacks \['role'\]"),
        ({"role": "user"}, r"message 1 lacks \['content'\]"),
        ({"role": "robot", "content": "hi"}, r"message 1 has role 'robot'"),
        ("hi", r"message 1 is a str"),
    ],
)
def test_bad_message(tmp_path, message, pattern):
    path = write_jsonl(tmp_path / "d.jsonl", ["", {"prompt": [MESSAGES[0], message], "label": "y"}])
    with pytest.raises(DataFormatError, match=r"d\.jsonl:2: " + pattern):
        load_prompts(path)


@pytest.mark.parametrize("prompt", [None, 3, "", []])
def test_bad_prompt_type(tmp_path, prompt):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "label": "y"}])
    with pytest.raises(DataFormatError, match=r"d\.jsonl:1: prompt"):
        load_prompts(path)


def test_non_dict_metadata(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", "", {"prompt": "x", "label": "y", "metadata": [1]}])
    with pytest.raises(
        DataFormatError, match=r"d\.jsonl:3: field 'metadata' \(metadata_key\) must be an object"
    ):
        load_prompts(path)


@pytest.mark.parametrize("tools", ["not json", json.dumps({"name": "calc"}), [1, 2]])
def test_bad_tools(tmp_path, tools):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "label": "y", "tools": tools}])
    with pytest.raises(DataFormatError, match=r"d\.jsonl:1: tools"):
        load_prompts(path)


def test_unknown_extension(tmp_path):
    (tmp_path / "d.csv").write_text("prompt,label\nx,y\n")
    with pytest.raises(DataFormatError, match=r"d\.csv: unknown prompt file format"):
        load_prompts(str(tmp_path / "d.csv"))


@pytest.mark.parametrize("suffix", ["", "@[5:10]"])
def test_empty_result(tmp_path, suffix):
    path = write_jsonl(tmp_path / "d.jsonl", ["", *([] if not suffix else numbered(2))])
    with pytest.raises(DataFormatError, match=re.escape(path + suffix) + ": .*yielded no records"):
        load_prompts(path + suffix)


def test_option_errors(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(1))
    with pytest.raises(ConfigError, match="apply_chat_template=True needs a tokenizer"):
        load_prompts(path, apply_chat_template=True)
    with pytest.raises(ConfigError, match="max_prompt_len needs a tokenizer"):
        load_prompts(path, max_prompt_len=10)
    with pytest.raises(ConfigError, match="apply_chat_template is False"):
        load_prompts(path, tokenizer=tokenizer, apply_chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(ConfigError, match=r"may not set \['tokenize'\]"):
        load_prompts(
            path, tokenizer=tokenizer, apply_chat_template=True, apply_chat_template_kwargs={"tokenize": True}
        )


def test_chat_template_receives_tools(tmp_path, tokenizer):
    rec = {"prompt": "add 2 and 2", "label": "4", "tools": json.dumps([{"name": "calculator_tool"}])}
    sample = load_prompts(
        write_jsonl(tmp_path / "d.jsonl", [rec]), tokenizer=tokenizer, apply_chat_template=True
    )[0]
    assert "calculator_tool" in sample.prompt and sample.prompt.endswith("<|im_start|>assistant\n")
    assert sample.metadata["tools"] == [{"name": "calculator_tool"}]
