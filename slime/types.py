"""`Sample`: the one record that flows from the data source through rollout to the trainer.

Field names, the nested `Sample.Status` enum and `to_dict`/`from_dict` follow THUDM/slime, so plugins
written for slime (custom generate, reward, filters) work on these objects unchanged. Multimodal
fields are left out: no stage here handles images or audio yet.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from slime.errors import DataFormatError


@dataclass
class SpecInfo:
    """Speculative-decoding counters accumulated over the engine calls of one sample."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

    @property
    def spec_accept_length(self) -> float:
        return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

    def add(self, meta_info: dict) -> None:
        self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
        self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
        self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
        self.completion_token_num += meta_info.get("completion_tokens", 0)


@dataclass
class PrefixCacheInfo:
    """Prompt tokens served from the engine's prefix cache, over the engine calls of one sample."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    def add(self, meta_info: dict) -> None:
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)


class Status(Enum):
    """Lifecycle of a sample. FAILED means a recoverable problem (tool error, reward error):
    the sample keeps whatever output it has and the reason is in `metadata`."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


def parse_weight_version(value: Any) -> int:
    """An engine's `meta_info.weight_version` as the integer the RL loop gave it (the rollout id the
    weights were trained through); 0 for an engine that never had an update ("default": the HF checkpoint a
    fresh run starts from) and -1 when absent or not an integer (another writer's label): unknown, oldest."""
    if value is None:
        return -1
    if value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


# SGLang's meta_info.finish_reason.type -> the status of the sample that received it.
_FINISH_REASON_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class Sample:
    """One prompt/response pair with everything training needs.

    `tokens` holds prompt + response token ids; `response_length`, `loss_mask`,
    `rollout_log_probs` and `token_weight_versions` cover only the response part (their lengths equal
    `response_length`). `weight_versions` is slime's: one entry per engine call; `token_weight_versions`
    (this project's) says which weight version generated each response token (-1: an environment token,
    or one from before versions were recorded), so a response continued across weight updates
    (partial rollout, fully async mode) keeps the version of every range (`slime.rollout.staleness`).
    """

    Status = Status  # slime's spelling: Sample.Status.COMPLETED
    SpecInfo = SpecInfo
    PrefixCacheInfo = PrefixCacheInfo

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    token_weight_versions: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-compatible dict (status as its string value, nested infos as dicts)."""
        value = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        value["status"] = self.status.value
        value["spec_info"] = dataclasses.asdict(self.spec_info)
        value["prefix_cache_info"] = dataclasses.asdict(self.prefix_cache_info)
        return value

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of `to_dict`. Unknown keys are an error: silently dropping them would lose data."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise DataFormatError(f"Sample.from_dict: unknown field(s) {unknown}; known fields: {sorted(names)}")
        kwargs = dict(data)
        if "status" in kwargs:
            try:
                kwargs["status"] = Status(kwargs["status"])
            except ValueError:
                valid = [s.value for s in Status]
                raise DataFormatError(
                    f"Sample.from_dict: field 'status' is {kwargs['status']!r}; expected one of {valid}"
                ) from None
        if isinstance(kwargs.get("spec_info"), dict):
            kwargs["spec_info"] = SpecInfo(**kwargs["spec_info"])
        if isinstance(kwargs.get("prefix_cache_info"), dict):
            kwargs["prefix_cache_info"] = PrefixCacheInfo(**kwargs["prefix_cache_info"])
        return cls(**kwargs)

    # ------------------------------------------------------------------ helpers slime plugins call

    def get_reward_value(self, args: Any) -> float:
        """The scalar reward; with `--reward-key`, the named entry of a dict reward."""
        key = getattr(args, "reward_key", None)
        if key:
            if not isinstance(self.reward, dict) or key not in self.reward:
                raise DataFormatError(
                    f"sample {self.index}: reward_key {key!r} set but reward is {self.reward!r}"
                )
            return self.reward[key]
        if isinstance(self.reward, dict):
            raise DataFormatError(
                f"sample {self.index}: reward is a dict {sorted(self.reward)}; set reward_key to pick one"
            )
        return self.reward

    @property
    def effective_response_length(self) -> int:
        """Number of response tokens that count in the loss."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def update_from_meta_info(self, args: Any, meta_info: dict[str, Any]) -> None:
        """Fold one SGLang `/generate` meta_info into the sample: weight version, cache and spec
        statistics, and the status implied by `finish_reason`."""
        if getattr(args, "sglang_speculative_algorithm", None):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(str(meta_info["weight_version"]))
        reason = (meta_info.get("finish_reason") or {}).get("type")
        if reason in _FINISH_REASON_STATUS:
            self.status = _FINISH_REASON_STATUS[reason]

    def validate(self) -> None:
        """Check the length invariants between tokens and the per-response-token lists."""
        where = f"sample index={self.index} group={self.group_index}"
        if self.response_length < 0 or self.response_length > len(self.tokens):
            raise DataFormatError(
                f"{where}: response_length {self.response_length} outside [0, len(tokens)={len(self.tokens)}]"
            )
        for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs", "token_weight_versions"):
            values = getattr(self, name)
            if values is not None and len(values) != self.response_length:
                raise DataFormatError(
                    f"{where}: len({name})={len(values)} but response_length={self.response_length}"
                )
        if isinstance(self.reward, float) and math.isnan(self.reward):
            raise DataFormatError(f"{where}: reward is NaN")
