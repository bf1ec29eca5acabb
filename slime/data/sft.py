"""SFT conversations -> training samples whose loss mask covers exactly the assistant's tokens.

Each record holds a chat (`messages_key`, default "messages"). The chat template renders and tokenizes
it and marks what the assistant produced (`return_assistant_tokens_mask`, which needs the template's
`{% generation %}` blocks, as the tiny kit's has). Everything before the first assistant token is the
prompt; after it, the loss mask is 1 on assistant tokens (content and end-of-turn) and 0 on the user
and tool turns in between, so multi-turn conversations train only on what the model said. Templates without
those blocks (Qwen's own) take slime's per-message rules instead (`sft.loss_mask_type`, `loss_mask.py`).
"""

from __future__ import annotations

from typing import Any

from slime.data.loss_mask import multi_turn_loss_mask
from slime.data.prompts import read_records
from slime.errors import DataFormatError
from slime.storage import ShardSet, is_committed
from slime.types import Sample


def conversation_sample(messages: list[dict[str, Any]], tokenizer: Any, *, index: int, where: str,
                        tools: list[dict] | None = None, loss_mask_type: str | None = None) -> Sample:
    """One conversation as a Sample: prompt = tokens before the first assistant token."""
    try:
        if loss_mask_type:  # slime's per-message rules for templates without {% generation %}
            ids, mask = multi_turn_loss_mask(tokenizer, messages, loss_mask_type, tools)
        else:
            encoded = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                    return_assistant_tokens_mask=True)
            ids, mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
    except DataFormatError as exc:
        raise DataFormatError(f"{where}: {exc}") from None
    except Exception as exc:  # template errors concern this record
        raise DataFormatError(f"{where}: chat template failed: {type(exc).__name__}: {exc}") from exc
    if not any(mask):
        raise DataFormatError(f"{where}: no assistant tokens to train on (no assistant message, or the chat "
                              "template lacks {% generation %} blocks)")
    prompt_length = mask.index(1)
    return Sample(index=index, group_index=index, prompt=messages, tokens=ids,
                  response=tokenizer.decode(ids[prompt_length:]), response_length=len(ids) - prompt_length,
                  loss_mask=mask[prompt_length:], status=Sample.Status.COMPLETED,
                  metadata={"tools": tools} if tools else {})


def load_sft_samples(path: str, tokenizer: Any, *, messages_key: str = "messages", tool_key: str | None = "tools",
                     max_length: int | None = None, storage_options: dict | None = None,
                     loss_mask_type: str | None = None) -> list[Sample]:
    """Read a JSONL/Parquet file of conversations (any fsspec URL, `path@[a:b]` slices) into samples,
    or the samples of a committed SFT shard set (e.g. the output of `slime rejection-sample`).

    Conversations longer than `max_length` tokens are an error naming the line, not silently cut.
    """
    if is_committed(path, storage_options):
        return load_sft_shard_set(path, max_length=max_length, storage_options=storage_options)
    samples = []
    for number, record in read_records(path, storage_options):
        where = f"{path.split('@[')[0]}:{number}"
        messages = record.get(messages_key)
        if not isinstance(messages, list) or not messages:
            raise DataFormatError(f"{where}: field {messages_key!r} (messages_key) must be a non-empty list of "
                                  f"chat messages; fields present: {sorted(record)}")
        tools = record.get(tool_key) if tool_key else None
        sample = conversation_sample(messages, tokenizer, index=len(samples), where=where, tools=tools,
                                     loss_mask_type=loss_mask_type)
        if max_length is not None and len(sample.tokens) > max_length:
            raise DataFormatError(f"{where}: conversation has {len(sample.tokens)} tokens, more than {max_length}")
        samples.append(sample)
    if not samples:
        raise DataFormatError(f"{path}: no conversations")
    return samples


def load_sft_shard_set(uri: str, *, max_length: int | None = None,
                       storage_options: dict | None = None) -> list[Sample]:
    """Samples of a committed shard set, checked to be trainable: tokens, a response and a loss mask over it."""
    samples = ShardSet.open(uri, storage_options).read_samples()
    for row, sample in enumerate(samples):
        where = f"{uri} row {row} (sample index {sample.index})"
        if sample.response_length <= 0 or sample.loss_mask is None or not any(sample.loss_mask):
            raise DataFormatError(f"{where}: no response tokens with loss_mask 1 to train on")
        sample.validate()
        if max_length is not None and len(sample.tokens) > max_length:
            raise DataFormatError(f"{where}: {len(sample.tokens)} tokens, more than {max_length}")
    if not samples:
        raise DataFormatError(f"{uri}: the shard set holds no samples")
    return samples
