"""Reward dispatch: which function scores a sample, and what happens when it fails.

Priority, as in slime's `rm_hub.async_rm`: `custom_rm_path` (`async def rm(args, sample)`, or with
`group_rm` `async def rm(args, samples) -> list`), then the sample's `metadata["rm_type"]`, then
`rm_type`. A `boxed_` prefix (`boxed_f1`) grades only the content of the last `\\boxed{}`.

Departure from slime: in `reward_samples` a reward function that raises does not abort the rollout.
The sample becomes `Status.FAILED` with `metadata["reward_error"] = "<Type>: <message>"` and no
reward, and every other sample is still scored; callers count FAILED samples instead of losing them.
`compute_reward` is the raising variant for callers that want the exception.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import math
import random
from collections.abc import Callable
from typing import Any

from slime.engines.client import EngineClient
from slime.errors import ConfigError, DataFormatError
from slime.plugins import check_signature, load_function
from slime.rollout.rewards.boxed import boxed_answer
from slime.rollout.rewards.dapo import dapo_reward
from slime.rollout.rewards.deepscaler import deepscaler_reward
from slime.rollout.rewards.f1 import f1_reward
from slime.rollout.rewards.gpqa import gpqa_reward
from slime.rollout.rewards.grading_process import set_max_processes
from slime.rollout.rewards.math_rm import math_reward, math_verify_reward
from slime.rollout.rewards.remote import make_rm_client, remote_reward
from slime.types import Sample, Status

logger = logging.getLogger(__name__)

# Rule-based graders: fn(response, label, metadata) -> float | dict.
RULE_REWARDS: dict[str, Callable[[str, Any, dict[str, Any]], Any]] = {
    "math": lambda response, label, metadata: math_reward(response, label),
    "math_verify": lambda response, label, metadata: math_verify_reward(response, label),
    "dapo": lambda response, label, metadata: dapo_reward(response, label),
    "deepscaler": lambda response, label, metadata: deepscaler_reward(response, label),
    "f1": lambda response, label, metadata: f1_reward(response, label),
    "gpqa": gpqa_reward,
}
RM_TYPES: tuple[str, ...] = (*RULE_REWARDS, "remote_rm", "random")
BOXED_PREFIX = "boxed_"
# Graders that find the box themselves: under `boxed_` they get the last box, not its content.
_BOX_READERS = ("math", "math_verify")


class RewardTypeError(ConfigError):
    """An rm_type (config or sample metadata) that names no known reward."""


def _flag(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def resolve_rm_type(args: Any, sample: Sample) -> str:
    """The rm_type that applies to `sample`: its metadata's, else the config's (validated)."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or _flag(args, "rm_type") or "").strip()
    if not rm_type:
        raise RewardTypeError("no reward function: set rm_type (--rm-type, one of "
                              f"{', '.join(RM_TYPES)}), custom_rm_path, or metadata.rm_type in the data")
    check_rm_type(rm_type, where="metadata.rm_type" if metadata.get("rm_type") else "rm_type")
    return rm_type


def check_rm_type(rm_type: str, *, where: str = "rm_type") -> None:
    """Raise RewardTypeError, with the closest known name, unless `rm_type` is known (with or without `boxed_`)."""
    base = rm_type.removeprefix(BOXED_PREFIX)
    if base in RM_TYPES:
        return
    known = [*RM_TYPES, *(BOXED_PREFIX + t for t in RULE_REWARDS)]
    close = difflib.get_close_matches(rm_type, known, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise RewardTypeError(f"{where}: unknown reward type {rm_type!r}{hint} (known: {', '.join(RM_TYPES)}, "
                          f"each also with the prefix {BOXED_PREFIX!r})")


def _checked(value: Any, source: str) -> float | dict[str, Any]:
    """A reward as stored on a Sample: a finite float, or a dict (picked later with reward_key)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, bool | int | float) and not isinstance(value, complex):
        value = float(value)
        if math.isnan(value):
            raise DataFormatError(f"{source} returned NaN")
        return value
    raise DataFormatError(f"{source} returned {type(value).__name__} {value!r}; expected a number or a dict")


async def compute_reward(args: Any, sample: Sample, *, client: EngineClient | None = None) -> float | dict:
    """The reward of one sample (not stored on it); raises whatever the reward function raises.

    `client` serves `remote_rm`; without one a temporary client is opened and closed here.
    """
    custom = _flag(args, "custom_rm_path")
    if custom:
        fn = load_function(custom)
        if _flag(args, "group_rm"):
            rewards = await fn(args, [sample])
            return _checked(_one_reward(rewards, 1, custom)[0], custom)
        return _checked(await fn(args, sample), custom)

    rm_type = resolve_rm_type(args, sample)
    response = sample.response or ""
    if rm_type.startswith(BOXED_PREFIX):
        rm_type = rm_type.removeprefix(BOXED_PREFIX)
        boxed = boxed_answer(response)
        # Departure: slime hands `math` the box's content, where it looks for a box again and finds none
        # (its `boxed_math` always scores 0); the math graders get the box itself.
        if rm_type in _BOX_READERS:
            response = "" if boxed is None else f"\\boxed{{{boxed}}}"
        else:
            response = boxed or ""
    if rm_type == "remote_rm":
        if client is not None:
            return _checked(await remote_reward(args, sample, client), f"remote_rm {_flag(args, 'rm_url')}")
        async with make_rm_client() as own:
            return _checked(await remote_reward(args, sample, own), f"remote_rm {_flag(args, 'rm_url')}")
    if rm_type == "random":
        return float(random.randint(0, 1))
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    # off the event loop: a grader (sympy, math-verify in the grading processes) takes milliseconds to
    # seconds, and the loop meanwhile streams every other request of the rollout
    reward = await asyncio.to_thread(RULE_REWARDS[rm_type], response, sample.label, metadata)
    return _checked(reward, f"rm_type {rm_type}")


def _one_reward(rewards: Any, expected: int, source: str) -> list[Any]:
    if not isinstance(rewards, list | tuple) or len(rewards) != expected:
        got = f"{len(rewards)} rewards" if isinstance(rewards, list | tuple) else type(rewards).__name__
        raise DataFormatError(f"group reward {source} returned {got} for {expected} samples; "
                              "expected a list with one reward per sample")
    return list(rewards)


def _fail(sample: Sample, exc: BaseException) -> None:
    sample.reward = None
    sample.status = Status.FAILED
    sample.metadata["reward_error"] = f"{type(exc).__name__}: {exc}"


def _store(args: Any, sample: Sample, reward: float | dict[str, Any]) -> None:
    """Set the reward; a dict reward must contain `reward_key` (else the trainer could not use it)."""
    sample.reward = reward
    if isinstance(reward, dict) or _flag(args, "reward_key"):
        sample.get_reward_value(args)  # raises DataFormatError naming the missing key


async def _reward_one(args: Any, sample: Sample, client: EngineClient | None) -> None:
    try:
        _store(args, sample, await compute_reward(args, sample, client=client))
    except Exception as exc:  # any user/grader error: record it on the sample, keep the rollout going
        logger.debug("reward of sample %s failed", sample.index, exc_info=True)
        _fail(sample, exc)


async def _reward_group(args: Any, samples: list[Sample]) -> None:
    path = _flag(args, "custom_rm_path")
    try:
        rewards = _one_reward(await load_function(path)(args, samples), len(samples), path)
        checked = [_checked(r, path) for r in rewards]
    except Exception as exc:  # one call scores the whole group, so its failure is every sample's
        for sample in samples:
            _fail(sample, exc)
        return
    for sample, reward in zip(samples, checked, strict=True):
        try:
            _store(args, sample, reward)
        except Exception as exc:
            _fail(sample, exc)


def _needs_client(args: Any, samples: list[Sample]) -> bool:
    if _flag(args, "custom_rm_path"):
        return False
    types = {(s.metadata.get("rm_type") if isinstance(s.metadata, dict) else None) or _flag(args, "rm_type")
             for s in samples}
    return any(t and t.strip().removeprefix(BOXED_PREFIX) == "remote_rm" for t in types)


async def reward_samples(args: Any, samples: list[Sample]) -> None:
    """Set `sample.reward` on every sample, concurrently; never raises for a failing reward.

    ABORTED samples are left as they are (slime skips them: they are regenerated or dropped). With
    `group_rm` and a `custom_rm_path`, the whole list is one call, as slime scores a group.
    """
    todo = [s for s in samples if s.status is not Status.ABORTED]
    if not todo:
        return
    if _flag(args, "group_rm") and _flag(args, "custom_rm_path"):
        await _reward_group(args, todo)
    else:
        client = make_rm_client() if _needs_client(args, todo) else None
        try:
            await asyncio.gather(*(_reward_one(args, s, client) for s in todo))
        finally:
            if client is not None:
                await client.aclose()
    failed = sum(1 for s in todo if s.status is Status.FAILED and "reward_error" in s.metadata)
    if failed:
        first = next(s for s in todo if s.status is Status.FAILED and "reward_error" in s.metadata)
        logger.warning("reward failed for %d of %d samples (first: %s)", failed, len(todo),
                       first.metadata["reward_error"])


def check_reward_config(args: Any) -> None:
    """Validate the reward settings at set-up time, before any engine starts.

    `args` is a `Config` or the flat namespace plugins see. Checks: the rm_type is known (closest-match
    suggestion), remote_rm has an rm_url, and a custom_rm_path imports and is an `async def` taking
    `(args, sample)` (or `(args, samples)` with group_rm). Raises ConfigError (PluginError for the path).
    Also sizes the grading process pool (`reward.grading_processes`).
    """
    if hasattr(args, "as_namespace"):
        args = args.as_namespace()
    set_max_processes(_flag(args, "grading_processes"))
    custom = _flag(args, "custom_rm_path")
    if custom:
        fn = load_function(custom)
        second = "samples" if _flag(args, "group_rm") else "sample"
        check_signature(fn, custom, ["args", second], is_async=True)
        return
    rm_type = _flag(args, "rm_type")
    if not rm_type:
        logger.warning("no rm_type and no custom_rm_path: every sample must carry metadata.rm_type")
        return
    check_rm_type(rm_type.strip())
    if rm_type.strip().removeprefix(BOXED_PREFIX) == "remote_rm" and not _flag(args, "rm_url"):
        raise ConfigError("rm_type remote_rm needs rm_url (--rm-url http://host:port/path)")
