"""`--flag value` command-line overrides: each flag to its section (typed fields by their flat name, `--sglang-*`
and `--router-*` to the pass-through dicts, anything else to `megatron`), its value typed by the field."""

from __future__ import annotations

import json
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml

from slime.config.tree import FIELD_SECTION, Config
from slime.errors import ConfigError


def _scalar(text: str) -> Any:
    """A pass-through value as a typed scalar: JSON/YAML number, bool, list or dict, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, int | float | bool | list | dict) else text


def _field_kind(section: str, name: str) -> str:
    """'bool', 'list', 'dict' or 'scalar': decides how many CLI tokens a flag consumes."""
    annotation = Config.model_fields[section].annotation.model_fields[name].annotation
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    kinds = {get_origin(a) or a for a in members} - {type(None)}
    if kinds == {bool}:
        return "bool"
    if list in kinds:
        return "list"
    if dict in kinds:
        return "dict"
    return "scalar"


_FLAG_ALIASES = {"async": "async_mode"}  # slime's spelling, not a Python identifier
# slime's argparse.BooleanOptionalAction flags: `--no-offload-train` is slime's own spelling of false
_NEGATABLE = frozenset({"offload_train", "offload_rollout"})


def parse_overrides(tokens: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """`--flag value` tokens -> (nested override dict, dotted path -> flag for error messages).

    Bool flags take no value (`--colocate`) or an explicit one (`--colocate false`); list flags take
    values up to the next `--flag`; dict flags take JSON (`--eval-prompt-data` also accepts
    `name path [name path ...]`, as in slime).
    """
    nested: dict[str, Any] = {}
    origin: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}: options look like --rollout-batch-size 8")
        flag, _, inline = token[2:].partition("=")
        values: list[str] = [inline] if inline else []
        i += 1
        if not inline:
            while i < len(tokens) and not (tokens[i].startswith("--") and len(tokens[i]) > 2):
                values.append(tokens[i])
                i += 1
        name = flag.replace("-", "_")
        name = _FLAG_ALIASES.get(name, name)
        if name.startswith("no_") and name[3:] in _NEGATABLE:
            if values:
                raise ConfigError(f"{token} takes no value (slime's negated --{flag[3:]}); give --{flag[3:]} "
                                  f"{' '.join(values)} instead")
            name, section = name[3:], FIELD_SECTION[name[3:]]
            nested.setdefault(section, {})[name] = False
            origin[f"{section}.{name}"] = f"--{flag}"
            continue
        for prefix in ("sglang", "router"):
            if name.startswith(prefix + "_") and name not in FIELD_SECTION:
                key = name[len(prefix) + 1 :]
                nested.setdefault(prefix, {})[key] = _pass_value(token, values)
                origin[f"{prefix}.{key}"] = f"--{flag}"
                break
        else:
            if name in FIELD_SECTION:
                section = FIELD_SECTION[name]
                aliased = flag.replace("-", "_") in _FLAG_ALIASES
                nested.setdefault(section, {})[name] = True if aliased and not values else \
                    _typed_value(token, _field_kind(section, name), values)  # --async: a plain flag
                origin[f"{section}.{name}"] = f"--{flag}"
            else:
                nested.setdefault("megatron", {})[name] = _pass_value(token, values)
                origin[f"megatron.{name}"] = f"--{flag}"
    return nested, origin


def _pass_value(flag: str, values: list[str]) -> Any:
    if not values:
        return True  # store_true style flag
    parsed = [_scalar(v) for v in values]
    return parsed[0] if len(parsed) == 1 else parsed


def _typed_value(flag: str, kind: str, values: list[str]) -> Any:
    if kind == "bool":
        if not values:
            return True
        if len(values) == 1 and values[0].lower() in {"true", "false", "1", "0", "yes", "no"}:
            return values[0].lower() in {"true", "1", "yes"}
        raise ConfigError(f"{flag}: expected no value or true/false, got {' '.join(values)!r}")
    if not values:
        raise ConfigError(f"{flag}: missing value")
    if kind == "list":
        return values
    if kind == "dict":
        if len(values) == 1:
            try:
                parsed = json.loads(values[0])
            except ValueError:
                raise ConfigError(f"{flag}: expected a JSON object, got {values[0]!r}") from None
            if not isinstance(parsed, dict):
                raise ConfigError(f"{flag}: expected a JSON object, got {values[0]!r}")
            return parsed
        if len(values) % 2:
            raise ConfigError(f"{flag}: expected JSON or 'name value' pairs, got {len(values)} values")
        return dict(zip(values[::2], values[1::2], strict=True))
    if len(values) != 1:
        raise ConfigError(f"{flag}: expected one value, got {' '.join(values)!r}")
    return values[0]
