"""Prompt datasets: read JSONL/Parquet prompt files from any fsspec URL into `Sample`s.

Behaviour follows THUDM/slime's `Dataset`/`read_file` (same record format, same `path@[a:b]` row
slicing) so slime datasets load unchanged, but the files may live anywhere fsspec reaches (local,
`file://`, `memory://`, `s3://`), and every bad record fails with its file and line instead of being
skipped or surfacing later as an opaque tokenizer error.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.utils import infer_compression

from slime.errors import ConfigError, DataFormatError
from slime.types import Sample

logger = logging.getLogger(__name__)

_SLICE_RE = re.compile(r"@\[(-?\d*):(-?\d*)\]")
_ROLES = ("system", "user", "assistant", "tool")
_RESERVED_TEMPLATE_KWARGS = ("tools", "tokenize", "add_generation_prompt")


def parse_data_path(path: str) -> tuple[str, slice | None]:
    """Split slime's `file@[start:stop]` row selector off a path (Python slice semantics)."""
    at = path.rfind("@[")
    if at == -1:
        return path, None
    match = _SLICE_RE.fullmatch(path[at:])
    if match is None or at == 0:
        raise DataFormatError(
            f"{path}: bad row slice {path[at:]!r}; expected PATH@[start:stop] with optional integer "
            "bounds, e.g. data.jsonl@[0:100], data.jsonl@[-50:]"
        )
    start, stop = (int(x) if x else None for x in match.groups())
    return path[:at], slice(start, stop)


def _file_format(path: str) -> str:
    """'jsonl' or 'parquet' from the extension, looking through a compression suffix (.gz, .zst...)."""
    name = path.lower()
    if infer_compression(name) is not None:
        name = name.rsplit(".", 1)[0]
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise DataFormatError(
        f"{path}: unknown prompt file format; supported extensions are .jsonl, .json (JSON lines) "
        "and .parquet, optionally compressed (.gz, .bz2, .xz, .zst)"
    )


def _where(path: str, number: int) -> str:
    """Location prefix for messages: `file:LINE` for JSONL, `file:row N` for Parquet."""
    return f"{path}:row {number}" if _file_format(path) == "parquet" else f"{path}:{number}"


def read_records(path: str, storage_options: dict | None = None) -> Iterator[tuple[int, dict]]:
    """Yield `(line or row number, 1-based, record)` for the rows that `path@[a:b]` selects.

    Blank JSONL lines are skipped but counted, so numbers always point into the file as it is.
    Lines outside the slice are never parsed: a slice can be used to skip a known-bad region.
    """
    real_path, row_slice = parse_data_path(path)
    fmt = _file_format(real_path)
    with fsspec.open(real_path, "rb", compression="infer", **(storage_options or {})) as f:
        if fmt == "parquet":
            yield from _parquet_records(real_path, f.read(), row_slice)
            return
        lines = ((n, raw) for n, raw in enumerate(f, start=1) if raw.strip())
        if row_slice is None:
            selected: Iterator[tuple[int, bytes]] = lines
        elif all(b is None or b >= 0 for b in (row_slice.start, row_slice.stop)):
            selected = itertools.islice(lines, row_slice.start, row_slice.stop)  # stream, no full read
        else:
            selected = iter(list(lines)[row_slice])
        for number, raw in selected:
            yield number, _parse_json_line(real_path, number, raw)


def _parse_json_line(path: str, number: int, raw: bytes) -> dict:
    """Decode one JSONL line into a dict, or fail naming `path:line`."""
    try:
        text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path}:{number}: not valid UTF-8: {e}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}:{number}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise DataFormatError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
    return record


def _parquet_records(path: str, data: bytes, row_slice: slice | None) -> Iterator[tuple[int, dict]]:
    """Rows of an in-memory Parquet file as plain dicts (lists, not numpy arrays, for list columns)."""
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(f"{path}: not a readable Parquet file: {e}") from None
    rows = range(table.num_rows)
    if row_slice is not None:
        rows = rows[row_slice]
        table = table.slice(rows.start, len(rows))
    yield from zip((r + 1 for r in rows), table.to_pylist(), strict=True)


def _check_prompt(where: str, prompt: Any) -> None:
    """A prompt is a non-empty string or a non-empty list of chat messages with known roles."""
    if isinstance(prompt, str):
        if not prompt:
            raise DataFormatError(f"{where}: prompt is an empty string")
        return
    if not isinstance(prompt, list) or not prompt:
        raise DataFormatError(
            f"{where}: prompt must be a string or a non-empty list of chat messages, got {prompt!r:.80}"
        )
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DataFormatError(f"{where}: message {i} is a {type(message).__name__}, expected a dict")
        missing = [k for k in ("role", "content") if k not in message]
        if missing:
            raise DataFormatError(f"{where}: message {i} lacks {missing}; keys present: {sorted(message)}")
        if message["role"] not in _ROLES:
            raise DataFormatError(
                f"{where}: message {i} has role {message['role']!r}; expected one of {_ROLES}"
            )


def _get_tools(where: str, value: Any) -> list[dict]:
    """Tools as a list of dicts; slime datasets store them either as a list or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{where}: tools field is a string but not valid JSON: {e.msg}") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataFormatError(f"{where}: tools must be a list of dicts (or its JSON text), got {value!r:.80}")
    return value


def _check_options(
    tokenizer: Any, apply_chat_template: bool, template_kwargs: dict | None, max_prompt_len: int | None
) -> None:
    """Reject option combinations that would otherwise be ignored or fail mid-file."""
    if apply_chat_template and tokenizer is None:
        raise ConfigError("apply_chat_template=True needs a tokenizer")
    if apply_chat_template and getattr(tokenizer, "chat_template", "") is None:
        raise ConfigError(f"data.apply_chat_template (--apply-chat-template) is set but the tokenizer of "
                          f"{getattr(tokenizer, 'name_or_path', '') or 'the model'} has no chat template: unset it "
                          "(raw prompts) or use a tokenizer that has one")
    if template_kwargs and not apply_chat_template:
        raise ConfigError("apply_chat_template_kwargs given but apply_chat_template is False")
    reserved = sorted(set(template_kwargs or {}) & set(_RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ConfigError(f"apply_chat_template_kwargs may not set {reserved}; load_prompts sets them")
    if max_prompt_len is not None:
        if tokenizer is None:
            raise ConfigError("max_prompt_len needs a tokenizer to count prompt tokens")
        if max_prompt_len <= 0:
            raise ConfigError(f"max_prompt_len must be positive, got {max_prompt_len}")


def load_prompts(
    path: str,
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = "metadata",
    tool_key: str | None = "tools",
    tokenizer: Any = None,
    apply_chat_template: bool = False,
    apply_chat_template_kwargs: dict | None = None,
    max_prompt_len: int | None = None,
    storage_options: dict | None = None,
) -> list[Sample]:
    """Load a prompt file (`path` may carry `@[a:b]`) into PENDING samples, one per prompt.

    Only prompts longer than `max_prompt_len` tokens are dropped (and the count logged); any other
    problem raises, because a silently shrunk dataset skews training without anyone noticing.
    """
    _check_options(tokenizer, apply_chat_template, apply_chat_template_kwargs, max_prompt_len)
    template_kwargs = apply_chat_template_kwargs or {}
    samples: list[Sample] = []
    dropped = total = 0
    real_path = parse_data_path(path)[0]
    for number, record in read_records(path, storage_options):
        total += 1
        where = _where(real_path, number)
        if input_key not in record:
            raise DataFormatError(
                f"{where}: missing field {input_key!r} (input_key); fields present: {sorted(record)}"
            )
        prompt = record[input_key]
        _check_prompt(where, prompt)
        if label_key is not None and label_key not in record:
            raise DataFormatError(
                f"{where}: missing field {label_key!r} (label_key); fields present: {sorted(record)}"
            )
        metadata = record.get(metadata_key) if metadata_key is not None else None
        if metadata is not None and not isinstance(metadata, dict):
            raise DataFormatError(
                f"{where}: field {metadata_key!r} (metadata_key) must be an object, got {metadata!r:.80}"
            )
        metadata = dict(metadata or {})
        tools = None
        if tool_key is not None and record.get(tool_key) is not None:
            tools = metadata["tools"] = _get_tools(where, record[tool_key])
        if apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            try:
                prompt = tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
                )
            except Exception as e:  # template errors (jinja raise_exception) concern this record
                raise DataFormatError(f"{where}: chat template failed: {type(e).__name__}: {e}") from e
        if max_prompt_len is not None:
            if not isinstance(prompt, str):
                raise ConfigError(
                    f"{where}: max_prompt_len needs text prompts but this one is a message list; "
                    "set apply_chat_template=True so its length can be measured on the templated text "
                    "(rollout_max_prompt_len defaults to rollout_max_context_len - 1 when a context length is set)"
                )
            if len(tokenizer.encode(prompt, add_special_tokens=False)) > max_prompt_len:
                dropped += 1
                continue
        index = len(samples)
        samples.append(
            Sample(
                index=index,
                group_index=index,
                prompt=prompt,
                label=record[label_key] if label_key is not None else None,
                metadata=metadata,
            )
        )
    if total == 0:
        raise DataFormatError(f"{path}: the file (and slice, if any) yielded no records")
    if dropped:
        logger.warning(
            "%s: dropped %d of %d prompts longer than max_prompt_len=%d tokens",
            path,
            dropped,
            total,
            max_prompt_len,
        )
    if not samples:
        raise ConfigError(
            f"{path}: all {total} prompts are longer than max_prompt_len={max_prompt_len} tokens"
        )
    return samples
