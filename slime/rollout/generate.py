"""The default per-sample generate function and the sampling parameters it is called with.

`generate(args, sample, sampling_params)` is what runs when no `custom_generate_function_path` is set:
one `/generate` call through the router with `input_ids` and `return_logprob` (and `return_routed_experts`
with routing replay on: routing.py), folded into the sample (tokens, log-probs, loss mask, status, weight
version, routed experts). A sample that comes back from the partial-rollout
buffer continues from its tokens with the response budget reduced by what it already has, so the final
sample is one continuous response. With `rollout_max_context_len` set, a request asks for at most
`min(max_new_tokens, rollout_max_context_len - prompt length)` tokens (slime), and a sample whose prompt
leaves no room is TRUNCATED without a request.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

from transformers import AutoTokenizer

from slime.errors import ConfigError
from slime.rollout.multiturn import append_model_output, budget_left, generate_turn, prompt_ids
from slime.rollout.routing import wants_routed_experts
from slime.types import Sample, Status


@functools.cache
def load_tokenizer(path: str) -> Any:
    """The HF tokenizer of `path` (cached: every sample of every rollout uses the same one)."""
    return AutoTokenizer.from_pretrained(path)


def tokenizer_of(args: Any) -> Any:
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        raise ConfigError("rollout needs hf_checkpoint (--hf-checkpoint) for the tokenizer that encodes prompts")
    return load_tokenizer(path)


def sampling_params_from_args(args: Any, *, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling params from the rollout settings (slime's GenerateState), or for evaluation the
    `eval_*` overrides falling back to them. Unset values (None) are left out."""

    def pick(eval_name: str, name: str) -> Any:
        value = getattr(args, eval_name, None) if evaluation else None
        return value if value is not None else getattr(args, name, None)

    params = {
        "temperature": pick("eval_temperature", "rollout_temperature"),
        "top_p": pick("eval_top_p", "rollout_top_p"),
        "top_k": pick("eval_top_k", "rollout_top_k"),
        "max_new_tokens": pick("eval_max_response_len", "rollout_max_response_len"),
        "stop": getattr(args, "rollout_stop", None),
        "stop_token_ids": getattr(args, "rollout_stop_token_ids", None),
        "skip_special_tokens": getattr(args, "rollout_skip_special_tokens", None),
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "min_new_tokens": getattr(args, "eval_min_new_tokens", None) if evaluation else None,
    }
    return {k: v for k, v in params.items() if v is not None}


def sample_seed(args: Any, sample: Sample, *, evaluation: bool = False) -> int | None:
    """The `sampling_seed` of `sample`'s generate call, from `rollout_seed` and the sample's own ids
    (None for a sample without an index). Engines seed each request from it, so a sample's tokens do not
    depend on which engine serves it, in what order requests arrive, or whether the engines were restarted
    by a resume: a resumed run regenerates exactly what an uninterrupted one would. A continued partial
    sample (response_length > 0) gets a fresh seed. 63 bits: SGLang keeps it in an int64 tensor."""
    if sample.index is None:
        return None
    key = f"{getattr(args, 'rollout_seed', 0)}:{'eval' if evaluation else 'rollout'}:{sample.group_index}:" \
          f"{sample.index}:{sample.response_length}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Generate (or continue) `sample`'s response with one `/generate` call through the router."""
    if sample.status not in (Status.PENDING, Status.ABORTED):
        raise ValueError(f"sample {sample.index}: cannot generate from status {sample.status.value}")
    if not sample.tokens:
        sample.tokens = prompt_ids(sample, tokenizer_of(args))
    if budget_left(sample, sampling_params, args) == 0:  # no room left: a resumed sample that used its
        return sample  # response budget, or a prompt that fills rollout_max_context_len (TRUNCATED, no request)
    output = await generate_turn(args, sample, sampling_params, return_routed_experts=wants_routed_experts(args))
    append_model_output(args, sample, output)
    return sample


def truncate_response(sample: Sample, max_len: int, tokenizer: Any = None) -> bool:
    """Cut the response to `max_len` tokens (a custom generate function may return more); True if cut.

    The text is re-decoded from the kept tokens when a tokenizer is given, else left as it was.
    """
    extra = sample.response_length - max_len
    if extra <= 0:
        return False
    sample.tokens = sample.tokens[: len(sample.tokens) - extra]
    sample.response_length = max_len
    for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs", "token_weight_versions"):
        values = getattr(sample, name)
        if values is not None:
            setattr(sample, name, values[:max_len])
    if sample.rollout_routed_experts is not None:  # one record per token but the last (routing.py)
        sample.rollout_routed_experts = sample.rollout_routed_experts[: max(len(sample.tokens) - 1, 0)]
    if tokenizer is not None:
        sample.response = tokenizer.decode(sample.tokens[len(sample.tokens) - max_len:] if max_len else [])
    sample.status = Status.TRUNCATED
    return True
