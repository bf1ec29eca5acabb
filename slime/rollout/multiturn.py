"""Build a sample's response turn by turn: model tokens train, environment/tool tokens do not.

A multi-turn generate function (`examples/calculator_tool.py`) alternates model turns, appended with
`append_model_output` (loss mask 1, the engine's log-probs, finish reason and weight version), and
environment turns (tool results, user replies), appended with `append_env_tokens` (loss mask 0, log-prob
0.0 as a placeholder the loss never reads). `tokens` stays prompt + response and every per-response list
stays `response_length` long, so the sample is ready for the trainer after any number of turns.
`generate_turn` sends the whole sample so far to the router for the next model turn.
"""

from __future__ import annotations

from typing import Any

from slime.rollout.http import engine_client, router_url
from slime.types import Sample, Status


def append_tokens(sample: Sample, tokens: list[int], *, log_probs: list[float] | None, trainable: bool,
                  text: str = "") -> None:
    """Append response tokens with their loss mask (1 if `trainable`) and log-probs (0.0 when absent)."""
    tokens = [int(t) for t in tokens]
    if log_probs is not None and len(log_probs) != len(tokens):
        raise ValueError(f"{len(log_probs)} log-probs for {len(tokens)} tokens")
    if trainable and tokens and log_probs is None:
        raise ValueError("trainable (model) tokens need the engine's log-probs")
    previous = sample.response_length
    if sample.loss_mask is None:
        sample.loss_mask = [1] * previous
    if sample.rollout_log_probs is None:
        if trainable and previous:
            raise ValueError(f"sample {sample.index} has {previous} response tokens but no rollout_log_probs; "
                             "cannot append trainable tokens after them")
        sample.rollout_log_probs = [0.0] * previous
    sample.tokens = list(sample.tokens) + tokens
    sample.response_length += len(tokens)
    sample.loss_mask += [1 if trainable else 0] * len(tokens)
    sample.rollout_log_probs += [float(x) for x in log_probs] if log_probs is not None else [0.0] * len(tokens)
    sample.response += text


def append_model_output(args: Any, sample: Sample, output: dict[str, Any]) -> None:
    """Fold one SGLang `/generate` answer (with `return_logprob`) into `sample` as a model turn: its tokens
    and log-probs, text, status from `finish_reason` (abort -> ABORTED) and weight version."""
    meta = output.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs") or []
    append_tokens(sample, [p[1] for p in pairs], log_probs=[p[0] for p in pairs], trainable=True,
                  text=output.get("text") or "")
    sample.update_from_meta_info(args, meta)


def append_env_tokens(sample: Sample, tokens: list[int], text: str = "") -> None:
    """Append environment/tool tokens: part of the context, excluded from the loss (mask 0)."""
    append_tokens(sample, tokens, log_probs=None, trainable=False, text=text)


def prompt_ids(sample: Sample, tokenizer: Any) -> list[int]:
    """Token ids of the prompt: a string is encoded as is, chat messages through the chat template."""
    if isinstance(sample.prompt, list):
        return list(tokenizer.apply_chat_template(sample.prompt, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    return tokenizer.encode(sample.prompt, add_special_tokens=False)


async def generate_turn(args: Any, sample: Sample, sampling_params: dict[str, Any],
                        max_new_tokens: int | None = None) -> dict[str, Any]:
    """POST `sample.tokens` (prompt + response so far) to the router's `/generate` and return its answer.

    `max_new_tokens` (default: what `sampling_params` allows) is capped by the response budget left,
    `sampling_params["max_new_tokens"] - sample.response_length`, so a whole multi-turn response never
    exceeds it. Does not modify `sample`; pass the answer to `append_model_output`.
    """
    params = dict(sampling_params)
    budget = params.get("max_new_tokens")
    if budget is not None:
        budget -= sample.response_length
        params["max_new_tokens"] = budget if max_new_tokens is None else min(budget, max_new_tokens)
    elif max_new_tokens is not None:
        params["max_new_tokens"] = max_new_tokens
    payload = {"input_ids": list(sample.tokens), "sampling_params": params, "return_logprob": True}
    return await engine_client().post(f"{router_url(args)}/generate", payload)


def budget_left(sample: Sample, sampling_params: dict[str, Any]) -> int | None:
    """Response tokens still allowed (None: no limit); at 0 the sample is TRUNCATED."""
    limit = sampling_params.get("max_new_tokens")
    if limit is None:
        return None
    left = limit - sample.response_length
    if left <= 0:
        sample.status = Status.TRUNCATED
    return max(left, 0)
