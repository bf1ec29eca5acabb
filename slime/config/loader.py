"""`load_config`: read the YAML file (keeping each key's line for messages), resolve its relative input paths,
apply the command-line overrides and --megatron-config-path's, validate once, and log the slime flags given that
this project does its own way."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from slime.config.base import _suggest
from slime.config.engine_flags import RENAMED_SGLANG_ARGS, flag_key, known_sglang_flags, renamed_sglang_args
from slime.config.megatron_flags import LAUNCH, NEGATED, no_effect_notes
from slime.config.overrides import _scalar, parse_overrides
from slime.config.passthrough import megatron_flag_names
from slime.config.slime_flags import LAUNCHER_ROUTER, MAPPED, PLUGIN_ONLY, refusal
from slime.config.tree import _PASS_THROUGH, _TYPED_SECTIONS, FIELD_SECTION, Config
from slime.config.validate import validate
from slime.errors import ConfigError

logger = logging.getLogger(__name__)


def _key_lines(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    """Record the 1-based line of every mapping key, by dotted path, for error messages."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            out[path] = key_node.start_mark.line + 1
            _key_lines(value_node, path, out)


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    lines: dict[str, int] = {}
    _key_lines(node, "", lines)
    return data, lines


def _check_yaml_keys(data: dict[str, Any], where: dict[str, str]) -> None:
    """Unknown sections or fields, with the section a misplaced flat key belongs to."""
    for key, value in data.items():
        if key in _PASS_THROUGH:
            if not isinstance(value, dict):
                raise ConfigError(f"{where.get(key, key)}: section {key!r} must be a mapping")
            continue
        if key not in _TYPED_SECTIONS:
            hint = f"; it belongs under '{FIELD_SECTION[key]}:'" if key in FIELD_SECTION else _suggest(
                key, [*_TYPED_SECTIONS, *_PASS_THROUGH]
            )
            raise ConfigError(f"{where.get(key, key)}: unknown section {key!r}{hint}")
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where.get(key, key)}: section {key!r} must be a mapping")
        for name in value:
            if FIELD_SECTION.get(name) != key:
                path = f"{key}.{name}"
                if name in FIELD_SECTION:
                    hint = f"; it belongs under '{FIELD_SECTION[name]}:'"
                elif why := refusal(name):
                    hint = f"; slime's --{name.replace('_', '-')} is not supported here: {why}"
                else:
                    hint = _suggest(name, [n for n, s in FIELD_SECTION.items() if s == key])
                raise ConfigError(f"{where.get(path, path)}: unknown field {path!r}{hint}")


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply `--flag value` overrides, validate everything once."""
    data: dict[str, Any] = {}
    where: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        data, lines = _read_yaml(path)
        where = {key: f"{path}:{line}" for key, line in lines.items()}
        _check_yaml_keys(data, where)
        data = {k: v for k, v in data.items() if v is not None}
        _resolve_inputs(data, path.absolute().parent)
    if overrides:
        nested, origin = parse_overrides(overrides)
        data = _merge(data, nested)
        where.update(origin)
    role_path = (data.get("train") or {}).get("megatron_config_path")
    if role_path:
        nested, origin = read_megatron_role_config(role_path, "actor")
        data = _merge(data, nested)
        where.update(origin)
    if isinstance(data.get("sglang"), dict):
        _move_router_flags(data, where)
        data["sglang"] = _renamed_sglang(data["sglang"], where)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, where)) from None
    renamed = {name: flag.field for name, flag in LAUNCH.items() if flag.kind == "renamed"}
    for name, field in {**NEGATED, **renamed}.items():  # later messages about the field name the flag that set it
        if f"megatron.{name}" in where and field in config.megatron:
            where.setdefault(f"megatron.{field}", where[f"megatron.{name}"])
    validate(config, where)
    config._sources = where
    _log_mapped(config, where)
    return config


def _move_router_flags(data: dict[str, Any], where: dict[str, str]) -> None:
    """slime's `--sglang-router-*` flags that set an option of the router (slime_flags.LAUNCHER_ROUTER) land in
    the `sglang` section by their prefix; move each to the `router` section under the router's option name."""

    sglang = data["sglang"]
    for key in [k for k in sglang if f"sglang_{flag_key(str(k))}" in LAUNCHER_ROUTER]:
        name = f"sglang_{flag_key(str(key))}"
        option, why = LAUNCHER_ROUTER[name]
        value, router = sglang.pop(key), data.setdefault("router", {})
        source = where.get(f"sglang.{key}", f"--{name.replace('_', '-')}")
        if not isinstance(router, dict):
            raise ConfigError(f"{where.get('router', 'router')}: section 'router' must be a mapping")
        given = next((k for k in router if flag_key(str(k)) == option), None)
        if given is not None and router[given] != value:
            raise ConfigError(f"{source}: slime's --{name.replace('_', '-')} {value!r} sets the router's "
                              f"--{option.replace('_', '-')}, which is also given as {router[given]!r}; keep one")
        router[given if given is not None else option] = value
        where.setdefault(f"router.{given if given is not None else option}", source)
        logger.info("--%s: passed to the router as --router-%s: %s", name.replace("_", "-"),
                    option.replace("_", "-"), why)


def _renamed_sglang(sglang: dict[str, Any], where: dict[str, str]) -> dict[str, Any]:
    """The `sglang` section with the old SGLang flag names of slime's scripts (`--sglang-cuda-graph-max-bs`) under
    the names the SGLang validated against has (sglang_server.RENAMED_SGLANG_ARGS), each rename logged; later
    messages about the new name name the flag that was given."""

    if not any(flag_key(str(key)) in RENAMED_SGLANG_ARGS for key in sglang):
        return sglang  # nothing to rename: SGLang's flags are not looked up here
    version, flags = known_sglang_flags()
    try:
        out, renamed = renamed_sglang_args(sglang, flags)
    except ConfigError as exc:
        given = [where[f"sglang.{key}"] for key in sglang if f"sglang.{key}" in where]
        raise ConfigError(f"{', '.join(given) or 'config'}: {exc}") from None
    for key, new in renamed.items():
        if f"sglang.{key}" in where:
            where.setdefault(f"sglang.{new}", where[f"sglang.{key}"])
        why = RENAMED_SGLANG_ARGS[flag_key(key)][1]
        logger.info("--sglang-%s: SGLang %s names it --%s, passed to the engines as --sglang-%s: %s",
                    flag_key(key).replace("_", "-"), version, new.replace("_", "-"), new.replace("_", "-"), why)
    return out


# inputs a stage reads (model, tokenizer, data, eval files, the kit); the pre-flight checks that they exist
INPUT_PATH_FIELDS = ("checkpoint.hf_checkpoint", "checkpoint.ref_load", "checkpoint.opd_teacher_load",
                     "checkpoint.load", "data.prompt_data",
                     "sft.sft_data", "rejection_sampling.rs_prompt_data", "rejection_sampling.rs_policy",
                     "eval.eval_prompt_data", "eval.eval_config", "export.origin_hf_dir", "kit.kit_recipe",
                     "kit.kit_dir", "lora.lora_adapter_path")


def resolve_input_path(value: Any, base: Path) -> Any:
    """A relative local path written in a YAML file, as a path from the file's directory `base` (URLs,
    absolute paths and non-strings stay as they are)."""
    if not isinstance(value, str) or "://" in value or not value:
        return value
    return os.path.normpath(base / os.path.expanduser(value))  # an absolute path stays itself


def _resolve_inputs(data: dict[str, Any], base: Path) -> None:
    """Relative local input paths set in a YAML file resolve against the file's directory, so a config
    means the same files from any working directory (CLI values stay relative to the working directory)."""
    for dotted in INPUT_PATH_FIELDS:
        section, name = dotted.split(".")
        values = data.get(section)
        if not isinstance(values, dict) or name not in values:
            continue
        value = values[name]
        values[name] = ({k: resolve_input_path(v, base) for k, v in value.items()} if isinstance(value, dict)
                        else resolve_input_path(value, base))


def _log_mapped(config: Config, where: dict[str, str]) -> None:
    """One log line per slime flag given that this project does its own way (slime_flags.MAPPED) or that
    only plugins read (slime_flags.PLUGIN_ONLY)."""
    for name, how in {**MAPPED, **PLUGIN_ONLY}.items():
        section = getattr(config, FIELD_SECTION[name])
        given = f"{FIELD_SECTION[name]}.{name}" in where
        if given or getattr(section, name) != type(section).model_fields[name].default:
            logger.info("--%s: %s", name.replace("_", "-"), how)
    for flag, why in no_effect_notes(config.megatron).items():  # Megatron-LM launch flags without a knob here
        logger.info("%s: accepted without effect here: %s", flag, why)


def read_megatron_role_config(path: str, role: str) -> tuple[dict[str, Any], dict[str, str]]:
    """slime's --megatron-config-path: the `overrides` (or `args`) of the one entry with `role` in the file's
    top-level `megatron` list, as a nested config update (typed fields to their sections, Megatron flags to
    the pass-through) and where each came from. As in slime, num_nodes/num_gpus_per_node are ignored (the
    cluster flags place the GPUs) and numbers YAML reads as strings (1e-5) become numbers."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"megatron_config_path {path}: no such file")
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"megatron_config_path {path}: invalid YAML: {exc}") from None
    entries = raw.get("megatron") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"megatron_config_path {path}: needs a top-level 'megatron' list, e.g. megatron: [{{name: "
                          "default, role: actor, overrides: {...}}]")
    mine = [e for e in entries if e.get("role") == role]
    if len(mine) > 1:
        raise ConfigError(f"megatron_config_path {path}: {len(mine)} entries with role {role}; at most one")
    for other in {e.get("role") for e in entries} - {role}:
        logger.info("megatron_config_path %s: role %r is not trained here (the RL train group runs the actor)",
                    path, other)
    values = (mine[0].get("overrides") or mine[0].get("args") or {}) if mine else {}
    if not isinstance(values, dict):
        raise ConfigError(f"megatron_config_path {path}: the {role} entry's overrides must be a mapping")
    nested: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in values.items():
        if key in ("num_nodes", "num_gpus_per_node"):
            logger.info("megatron_config_path %s: %s ignored: GPU placement follows the cluster flags", path, key)
            continue
        if isinstance(value, str):
            value = _scalar(value)
        section = FIELD_SECTION.get(key)
        if section is None and key not in megatron_flag_names() and key not in NEGATED and key not in LAUNCH:
            raise ConfigError(f"megatron_config_path {path}: {role} override {key!r} is neither a config field nor "
                              f"a Megatron flag{_suggest(key, [*FIELD_SECTION, *megatron_flag_names(), *LAUNCH])}")
        nested.setdefault(section or "megatron", {})[key] = value
        origin[f"{section or 'megatron'}.{key}"] = f"{path} ({role} overrides.{key})"
    return nested, origin


def _format_validation_error(exc: ValidationError, where: dict[str, str]) -> str:
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        # the most specific known location: field, then its section
        dotted = ".".join(loc[:2])
        source = where.get(dotted) or where.get(loc[0]) or "config"
        given = f" (got {err['input']!r})" if err["type"] != "missing" and not isinstance(err["input"], dict) else ""
        problems.append(f"{source}: {'.'.join(loc)}: {err['msg']}{given}")
    return "invalid configuration:\n  " + "\n  ".join(problems)
