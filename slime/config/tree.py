"""The whole configuration tree: `Config` (the typed sections and the `sglang`, `router`, `megatron`
pass-through dicts), the index of flat field names to their sections, the content hash of sections, and the
--custom-config-path attributes `Config.as_namespace` adds for plugins."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from slime.config.base import Fail
from slime.config.checkpoint import CheckpointConfig
from slime.config.lora import LoraConfig
from slime.config.megatron_flags import negated_options, renamed_options
from slime.config.rollout import DataConfig, EngineConfig, EvalConfig, RewardConfig, RolloutConfig
from slime.config.run import ClusterConfig, KitConfig, RunConfig
from slime.config.stages import ExportConfig, RejectionSamplingConfig
from slime.config.sync import SyncConfig
from slime.config.training import AlgorithmConfig, SftConfig, TrainConfig
from slime.errors import ConfigError


class Config(BaseModel):
    """The whole configuration. Sections are typed; `sglang`, `router`, `megatron` pass through."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run: RunConfig = Field(default_factory=RunConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    rejection_sampling: RejectionSamplingConfig = Field(default_factory=RejectionSamplingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    kit: KitConfig = Field(default_factory=KitConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    sglang: dict[str, Any] = Field(default_factory=dict)
    router: dict[str, Any] = Field(default_factory=dict)
    megatron: dict[str, Any] = Field(default_factory=dict)
    # dotted field -> where it was set ("file.yaml:12" or "--flag"), for messages of later checks
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _context_defaults(self) -> Config:
        """slime's defaults from rollout_max_context_len: eval_max_context_len is the same bound, and prompts
        are at most rollout_max_context_len - 1 tokens, leaving one generated token for the loss
        (rollout.check_prompt_fits_context refuses a larger rollout_max_prompt_len)."""
        context = self.rollout.rollout_max_context_len
        if self.eval.eval_max_context_len is None and context is not None:
            self.eval.eval_max_context_len = context
        if self.data.rollout_max_prompt_len is None and context is not None:
            self.data.rollout_max_prompt_len = context - 1
        return self

    @field_validator("megatron", mode="before")
    @classmethod
    def _negated_flags(cls, value: Any) -> Any:
        """Megatron-LM's `--no-rope-fusion` & co. become the megatron-core field they set False, and its other
        names of megatron-core fields (`--decoder-first-pipeline-num-layers`) that field (megatron_flags)."""
        return negated_options(renamed_options(value)) if isinstance(value, dict) else value

    def source(self, dotted: str) -> str | None:
        """Where `section.field` was set (YAML file and line, or the CLI flag); None for a default."""
        return self._sources.get(dotted)

    def section_hash(self, *sections: str) -> str:
        """sha256 of the canonical JSON of the named sections (all of them when none is named), each with the
        values set away from their defaults.

        Stable across processes and key order; any changed value changes it. Fields left at their defaults are
        not in it, so a later version that adds a field with a default (or a config that spells a default
        out) keeps the hash, and a committed output keyed by it (rejection sampling's) stays reusable. Hashes
        of this project before 2026-11-26 covered every field.
        """
        names = sections or tuple(type(self).model_fields)
        for name in names:
            if name not in type(self).model_fields:
                raise ConfigError(f"unknown config section {name!r}; sections: {list(type(self).model_fields)}")
        payload = {name: _set_values(getattr(self, name)) for name in names}
        return stable_hash(payload)

    def sglang_arg(self, name: str) -> Any:
        """The SGLang pass-through flag `name` (underscored, `mem_fraction_static`), however its key was
        spelt (`--sglang-mem-fraction-static`, a YAML `mem-fraction-static`); None when not given."""
        return next((v for k, v in self.sglang.items() if str(k).replace("-", "_") == name), None)

    def sft_train(self) -> TrainConfig:
        """The `train` section as SFT uses it: with the sft_lr/sft_min_lr/... overrides applied."""
        return self.train.model_copy(update=self.sft.train_overrides())

    def require(self, *fields: str, stage: str) -> None:
        """Fail early, naming every missing field, when a stage needs fields that default to None."""
        missing = []
        for dotted in fields:
            section, name = dotted.split(".")
            if getattr(getattr(self, section), name) is None:
                missing.append(f"{dotted} (--{name.replace('_', '-')})")
        if missing:
            raise ConfigError(f"stage {stage!r} needs: {', '.join(missing)}")

    def as_namespace(self) -> argparse.Namespace:
        """Flat `args` with slime's attribute names, for plugins written against slime.

        Pass-through sections appear as `sglang_<flag>` / `router_<flag>` attributes and Megatron
        flags under their own names, as slime's merged parser would give them.
        """
        flat: dict[str, Any] = {}
        for section in _TYPED_SECTIONS:
            flat.update(getattr(self, section).model_dump())
        flat.update({f"sglang_{k}": v for k, v in self.sglang.items()})
        flat.update({f"router_{k}": v for k, v in self.router.items()})
        for key, value in self.megatron.items():
            flat.setdefault(key, value)
        if self.run.custom_config_path:  # slime sets these on args after parsing
            flat.update(read_custom_config(self.run.custom_config_path))
        return argparse.Namespace(**flat)


_PASS_THROUGH = ("sglang", "router", "megatron")
_TYPED_SECTIONS = tuple(name for name in Config.model_fields if name not in _PASS_THROUGH)


def _build_field_index() -> dict[str, str]:
    """flat field name -> section. Names must be unique so that flat CLI flags are unambiguous."""
    index: dict[str, str] = {}
    for section in _TYPED_SECTIONS:
        for name in Config.model_fields[section].annotation.model_fields:
            if name in index:
                raise RuntimeError(f"config field {name!r} is defined in both {index[name]!r} and {section!r}")
            index[name] = section
    return index


FIELD_SECTION: dict[str, str] = _build_field_index()


def _set_values(value: Any) -> Any:
    """A section as JSON with only its values set away from their defaults (a dict section: all of it)."""
    return value.model_dump(mode="json", exclude_defaults=True) if isinstance(value, BaseModel) else value


def stable_hash(payload: Any) -> str:
    """sha256 hex of canonical JSON (sorted keys, no whitespace): equal content, equal hash."""
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def read_custom_config(path: str) -> dict[str, Any]:
    """The attributes a --custom-config-path YAML adds to plugins' `args`; config field names are refused
    (set those as flags: they are validated)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"custom_config_path {path}: no such file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"custom_config_path {path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"custom_config_path {path}: expected a mapping of names to values, got "
                          f"{type(data).__name__}")
    typed = sorted(set(data) & set(FIELD_SECTION))
    if typed:
        raise ConfigError(f"custom_config_path {path}: {typed[0]!r} is a config field: set it as "
                          f"--{typed[0].replace('_', '-')} (or {FIELD_SECTION[typed[0]]}.{typed[0]}), where it "
                          "is validated")
    return data


def check_custom_config(config: Config, fail: Fail) -> None:
    """The --custom-config-path file reads, without config field names."""
    if config.run.custom_config_path:
        try:
            read_custom_config(config.run.custom_config_path)
        except ConfigError as exc:
            fail("run.custom_config_path", str(exc))
