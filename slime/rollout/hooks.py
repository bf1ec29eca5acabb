"""The rollout's plugins, loaded by dotted path and signature-checked when a rollout is set up.

Every hook keeps slime's signature (docs/rollout.md lists them):

| field | called as |
|---|---|
| `rollout_function_path` | `generate_rollout(args, rollout_id, data_source, evaluation=False)` |
| `custom_generate_function_path` | `await generate(args, sample, sampling_params[, evaluation=...])` -> Sample or list[Sample] |
| `dynamic_sampling_filter_path` | `filter(args, samples)` -> DynamicFilterOutput or bool |
| `buffer_filter_path` | `filter(args, rollout_id, buffer, num_groups)` -> list of groups |
| `rollout_sample_filter_path` | `filter(args, data)` (sets `sample.remove_sample`) |
| `rollout_all_samples_process_path` | `process(args, all_samples, data_source)` |
| `rollout_sample_hook_path` (list) | `hook(args, sample, *, rollout_id=None, evaluation=False)` -> Sample or None, sync or async |
| `eval_function_path` | as `rollout_function_path`, called with `evaluation=True` |
| `custom_rollout_log_function_path` | `log(rollout_id, args, samples, rollout_extra_metrics, rollout_time)` -> bool |
| `custom_eval_rollout_log_function_path` | `log(rollout_id, args, data, extra_metrics)` -> bool |
| `custom_rm_path` | see slime.rollout.rewards |

`check_rollout_plugins(args)` runs all of these checks before any generation, so a typo in a path or a
wrong signature fails with a `PluginError` naming the field, not halfway through a rollout.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slime.data.source import BUFFER_FILTER_PARAMS
from slime.errors import ConfigError
from slime.plugins import PluginError, check_signature, load_function, load_plugin_field
from slime.rollout.filters import FILTER_PARAMS
from slime.rollout.generate import generate as default_generate
from slime.rollout.generate import tokenizer_of
from slime.rollout.rewards import check_reward_config
from slime.types import Sample

GENERATE_PARAMS = ["args", "sample", "sampling_params"]
ROLLOUT_FUNCTION_PARAMS = ["args", "rollout_id", "data_source"]
SAMPLE_FILTER_PARAMS = ["args", "data"]
ALL_SAMPLES_PROCESS_PARAMS = ["args", "all_samples", "data_source"]
SAMPLE_HOOK_PARAMS = ["args", "sample"]
ROLLOUT_LOG_PARAMS = ["rollout_id", "args", "samples", "rollout_extra_metrics", "rollout_time"]
EVAL_LOG_PARAMS = ["rollout_id", "args", "data", "extra_metrics"]


_load = load_plugin_field


def load_rollout_function(args: Any) -> Callable[..., Any]:
    """The step function named by `rollout_function_path` (default `slime.rollout.generate_rollout`),
    checked: `fn(args, rollout_id, data_source, evaluation=False)`. The RL loop calls what this returns."""
    fn = _load(args, "rollout_function_path", ROLLOUT_FUNCTION_PARAMS, is_async=False)
    if fn is None:
        raise ConfigError("rollout_function_path (--rollout-function-path) is empty")
    return fn


def load_eval_function(args: Any) -> Callable[..., Any]:
    """slime's eval rollout function: `eval_function_path`, else the rollout function; called as
    `fn(args, rollout_id, data_source, evaluation=True)`."""
    fn = _load(args, "eval_function_path", ROLLOUT_FUNCTION_PARAMS, is_async=False)
    return fn if fn is not None else load_rollout_function(args)


def load_log_functions(args: Any) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """(custom rollout log function, custom eval log function), checked; None where not configured."""
    return (_load(args, "custom_rollout_log_function_path", ROLLOUT_LOG_PARAMS, is_async=False),
            _load(args, "custom_eval_rollout_log_function_path", EVAL_LOG_PARAMS, is_async=False))


def load_sample_hooks(args: Any) -> list[tuple[str, Callable[..., Any]]]:
    """The `rollout_sample_hook_path` hooks, in order, each checked to take `(args, sample)` (sync or async)."""
    hooks = []
    for path in getattr(args, "rollout_sample_hook_path", None) or []:
        try:
            fn = load_function(path)
            check_signature(fn, path, SAMPLE_HOOK_PARAMS)
        except PluginError as e:
            raise PluginError(f"rollout_sample_hook_path (--rollout-sample-hook-path): {e}") from e
        hooks.append((path, fn))
    return hooks


async def apply_sample_hooks(hooks: list[tuple[str, Callable[..., Any]]], args: Any, sample: Sample, *,
                             rollout_id: int | None, evaluation: bool) -> Sample:
    """slime's rollout sample hooks on one generated sample, in order: each gets `rollout_id` and
    `evaluation` when its signature names them (or takes **kwargs); a returned Sample replaces the sample,
    None keeps it."""
    for path, fn in hooks:
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        kwargs = {k: v for k, v in (("rollout_id", rollout_id), ("evaluation", evaluation))
                  if takes_all or k in params}
        result = fn(args, sample, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        if result is not None:
            if not isinstance(result, Sample):
                raise TypeError(f"rollout sample hook {path!r} returned {type(result).__name__}, expected Sample "
                                "or None")
            sample = result
    return sample


def load_generate_function(path: str) -> Callable[..., Any]:
    """A custom generate function (`async def generate(args, sample, sampling_params)`), checked."""
    fn = load_function(path)
    check_signature(fn, path, GENERATE_PARAMS, is_async=True)
    return fn


def accepts_evaluation(fn: Callable[..., Any]) -> bool:
    """slime passes `evaluation=` only to generate functions that declare it."""
    try:
        return "evaluation" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class RolloutPlugins:
    """The loaded hooks of one rollout (None: not configured)."""

    generate: Callable[..., Any]
    dynamic_filter: Callable[..., Any] | None
    sample_filter: Callable[..., Any] | None
    all_samples_process: Callable[..., Any] | None
    sample_hooks: list[tuple[str, Callable[..., Any]]] = field(default_factory=list)


def check_rollout_plugins(args: Any, *, load_tokenizer: bool = True) -> RolloutPlugins:
    """Load and check every rollout hook and the reward settings; raise before any generation (and without
    `load_tokenizer`, before the model's tokenizer is loaded: the RL driver checks, its rollout manager loads)."""
    if hasattr(args, "as_namespace"):
        args = args.as_namespace()
    _load(args, "rollout_function_path", ROLLOUT_FUNCTION_PARAMS, is_async=False)
    _load(args, "buffer_filter_path", BUFFER_FILTER_PARAMS, is_async=False)
    custom = _load(args, "custom_generate_function_path", GENERATE_PARAMS, is_async=True)
    if custom is None and load_tokenizer:
        tokenizer_of(args)  # the default generate encodes prompts: fail now if there is no tokenizer
    check_reward_config(args)
    if getattr(args, "partial_rollout", False) and not getattr(args, "rollout_max_response_len", None):
        raise ConfigError("partial_rollout needs rollout_max_response_len (--rollout-max-response-len): a resumed "
                          "sample continues with the response budget it has left")
    return RolloutPlugins(
        generate=custom or default_generate,
        dynamic_filter=_load(args, "dynamic_sampling_filter_path", FILTER_PARAMS, is_async=False),
        sample_filter=_load(args, "rollout_sample_filter_path", SAMPLE_FILTER_PARAMS, is_async=False),
        all_samples_process=_load(args, "rollout_all_samples_process_path", ALL_SAMPLES_PROCESS_PARAMS,
                                  is_async=False),
        sample_hooks=load_sample_hooks(args),
    )
