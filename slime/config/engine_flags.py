"""The engines' pass-through flags: SGLang's launch flags, sglang-router's, the built-in engine's dtypes and
slime's external-engine addresses, as tables and checks that start nothing.

Every `--sglang-<flag>` a user sets reaches the `sglang:` config section as `{flag_underscored: value}` and is
forwarded verbatim to each engine; `--router-<flag>` likewise to the router. `load_config` checks each key
here before anything starts, so a typo fails at config time with a suggestion instead of killing an engine
minutes into a GPU job. The reference is the installed SGLang (its `ServerArgs` fields and CLI parser) when it
can be imported, else the flag list of the pinned version in `sglang_flags.txt`; the router's flags come from
the installed `sglang_router`. The engines (`slime/engines/`) build their command lines from the same tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import logging
from collections.abc import Mapping
from importlib import resources
from typing import Any

from slime.errors import ConfigError

logger = logging.getLogger(__name__)

PINNED_SGLANG_VERSION = "0.5.23"

# the built-in engine's --dtype values: SGLang's, aliases included (half, float); "auto" is bf16 on CUDA and fp32
# on the CPU. Here, free of torch, for the config check; the engine maps them (engine.py `_resolve_dtype`)
DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")

# sglang-router's RouterArgs.request_timeout_secs default: how long one attempt of a forwarded request may
# take when --router-request-timeout-secs is not given (slime passes 14400; here the router keeps its own).
# 0.3.2 retries an attempt it cut (--router-retry-max-retries): 2 s and a 5 s generate gave HTTP 500 after 10.4 s
ROUTER_REQUEST_TIMEOUT_S = 1800.0

# Router flags this class sets itself -> what controls them instead.
RESERVED_ROUTER_ARGS: dict[str, str] = {
    "host": "the router binds `engine.sglang_router_ip` (SGLangRouter `host`)",
    "port": "`engine.sglang_router_port` (SGLangRouter `port`; None picks a free one)",
    "prometheus_port": "SGLangRouter picks a free Prometheus port so that several routers can share a host",
    "prometheus_host": "the Prometheus exporter binds the router host",
    "worker_urls": "engines are registered by slime (SGLangRouter `worker_urls` / `add_worker`)",
    "help": "it is not a router setting",
}


def flag_key(flag: str) -> str:
    """A pass-through flag as a config key: `--mem-fraction-static` / `mem-fraction-static` -> `mem_fraction_static`."""
    return flag.strip().lstrip("-").replace("-", "_")


def flags_to_argv(flags: Mapping[str, Any]) -> list[str]:
    """`{"mem_fraction_static": 0.7, "enable_x": True, "cuda_graph_bs": [1, 2]}` -> CLI arguments.

    Keys are underscored names (`-` also accepted); the flag is `--` plus the name with dashes.
    True -> bare flag; False or None -> omitted; list/tuple -> the flag once followed by every value
    (argparse `nargs`); dict -> its JSON (e.g. `--json-model-override-args`); anything else ->
    `str(value)`. Order follows the mapping.
    """
    argv: list[str] = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, list | tuple):
            argv.append(flag)
            argv.extend(str(v) for v in value)
        elif isinstance(value, dict):
            argv.extend([flag, json.dumps(value)])
        else:
            argv.extend([flag, str(value)])
    return argv


# Pass-through keys the launcher sets itself -> what controls them instead.
RESERVED_SGLANG_ARGS: dict[str, str] = {
    "model_path": "the engines load `checkpoint.hf_checkpoint` (--hf-checkpoint), then receive weight updates",
    "model": "the engines load `checkpoint.hf_checkpoint` (--hf-checkpoint); `--model` is an alias of --model-path",
    "host": "the launcher binds each engine itself (127.0.0.1 on one host; the SGLangEngine `host` argument)",
    "port": "the launcher picks a free port per engine; the router's port is `engine.sglang_router_port`",
    "config": "slime's --sglang-config (a YAML of models and server groups: several models, prefill/decode groups, "
              "per-group overrides) is not built here: the rollout's engines serve one model, all alike; SGLang's "
              "own --config file: put its flags in the `sglang:` section of the slime config (or --sglang-<flag>)",
    "help": "it is not a server setting",
}


# SGLang flags slime's launch scripts pass (THUDM/slime 624b824a scripts/) under the names of the SGLang they were
# written for, which SGLang 0.5.23 spells differently -> (its name, why). Read in sglang 0.5.23's
# srt/arg_groups/fields/exec_.py and cuda_graph_hook.py: the CUDA-graph flags were split per phase (decode,
# prefill); the old ones set the decode graphs, the only graphs the old flags' SGLang captured.
RENAMED_SGLANG_ARGS: dict[str, tuple[str, str]] = {
    "cuda_graph_max_bs": ("cuda_graph_max_bs_decode", "the largest batch size captured in the decode CUDA graph; "
                          "SGLang split its CUDA-graph flags per phase"),
    "cuda_graph_bs": ("cuda_graph_bs_decode", "the batch sizes captured in the decode CUDA graph; SGLang split its "
                      "CUDA-graph flags per phase"),
    "mamba_scheduler_strategy": ("mamba_radix_cache_strategy", "the hybrid-Mamba cache strategy, same choices "
                                 "auto, no_buffer, extra_buffer, plus extra_buffer_lazy"),
    "nsa_prefill_backend": ("dsa_prefill_backend", "DeepSeek sparse attention's prefill kernel: NSA is now DSA"),
    "nsa_decode_backend": ("dsa_decode_backend", "DeepSeek sparse attention's decode kernel: NSA is now DSA"),
}


def renamed_sglang_args(args: Mapping[str, Any], flags: frozenset[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(`args` with each old name of `RENAMED_SGLANG_ARGS` replaced by SGLang's current one, {key as given: new key}).

    Only where the SGLang validated against (`flags`, `known_sglang_flags`) lacks the old flag and has the new one,
    so an older installed SGLang still gets the name it knows. The old and the new name both given with
    different values is refused; other keys stay as they are.
    """
    out = dict(args)
    renamed: dict[str, str] = {}
    for key in list(out):
        old = flag_key(str(key))
        if old not in RENAMED_SGLANG_ARGS:
            continue
        new = RENAMED_SGLANG_ARGS[old][0]
        if _flag(old) in flags or _flag(new) not in flags:
            continue
        value = out.pop(key)
        given = next((k for k in out if flag_key(str(k)) == new), None)
        if given is not None and out[given] != value:
            raise ConfigError(f"--sglang-{old.replace('_', '-')} {value!r} is SGLang's old name of "
                              f"--{new.replace('_', '-')}, which is also given as {out[given]!r}; keep one of them")
        renamed[str(key)] = given if given is not None else new
        out[renamed[str(key)]] = value
    return out, renamed


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


@functools.cache
def pinned_sglang_flags() -> frozenset[str]:
    """Launch flags of the pinned SGLang version, from `sglang_flags.txt` (`--mem-fraction-static`, ...)."""
    text = resources.files("slime.config").joinpath("sglang_flags.txt").read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip().startswith("--"))


@functools.cache
def installed_sglang_flags() -> tuple[str, frozenset[str]] | None:
    """(version, flags) of the importable SGLang: `ServerArgs` fields and its CLI parser; None if absent."""
    try:
        import sglang
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:  # not installed, or installed without CUDA libraries
        logger.debug("SGLang is not importable (%s); validating against the pinned flag list", exc)
        return None
    flags = {_flag(f.name) for f in dataclasses.fields(ServerArgs)} if dataclasses.is_dataclass(ServerArgs) else set()
    try:
        parser = argparse.ArgumentParser(add_help=False)
        ServerArgs.add_cli_args(parser)
        flags.update(opt for action in parser._actions for opt in action.option_strings if opt.startswith("--"))
    except Exception as exc:
        logger.debug("ServerArgs.add_cli_args failed (%s); using dataclass fields only", exc)
    if not flags:
        return None
    return str(getattr(sglang, "__version__", "installed")), frozenset(flags)


def known_sglang_flags() -> tuple[str, frozenset[str]]:
    """(version, flags) validation uses: the installed SGLang when importable, else the pinned list."""
    return installed_sglang_flags() or (PINNED_SGLANG_VERSION, pinned_sglang_flags())


def check_sglang_args(args: Mapping[str, Any]) -> None:
    """Raise ConfigError unless every key of `args` is a real SGLang launch flag that slime passes through.

    Keys are underscored flag names (`mem_fraction_static` for `--mem-fraction-static`). All problems
    are reported in one message, each with the `--sglang-<flag>` spelling and the closest real flag.
    """
    version, flags = known_sglang_flags()
    problems: list[str] = []
    for raw in args:
        key = flag_key(str(raw))
        if key in RESERVED_SGLANG_ARGS:
            problems.append(f"--sglang-{key.replace('_', '-')} cannot be passed through: "
                            f"{RESERVED_SGLANG_ARGS[key]}")
            continue
        if _flag(key) in flags:
            continue
        close = difflib.get_close_matches(_flag(key), sorted(flags), n=1, cutoff=0.6)
        hint = f"; did you mean --sglang-{close[0][2:]}?" if close else ""
        problems.append(f"--sglang-{key.replace('_', '-')} is not a flag of SGLang {version}{hint}")
    if problems:
        raise ConfigError("invalid sglang pass-through argument(s):\n  " + "\n  ".join(problems))


@functools.cache
def router_flags() -> frozenset[str] | None:
    """Every `--flag` of the installed `sglang_router.launch_router` (None if it cannot be imported)."""
    try:
        from sglang_router.router_args import RouterArgs
    except Exception as exc:
        logger.warning("cannot import sglang_router (%s): router flags are not validated", exc)
        return None
    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return frozenset(opt for action in parser._actions for opt in action.option_strings if opt.startswith("--"))


def request_timeout_s(router_args: Mapping[str, Any]) -> float:
    """The router's bound on one forwarded request: `request_timeout_secs` of the `router` pass-through
    (any spelling of the key), else sglang-router's default."""
    given = next((v for k, v in router_args.items() if flag_key(str(k)) == "request_timeout_secs"), None)
    if given is None:
        return ROUTER_REQUEST_TIMEOUT_S
    try:
        return float(given)
    except (TypeError, ValueError):
        raise ConfigError(f"--router-request-timeout-secs must be a number of seconds, got {given!r}") from None


def check_router_args(args: Mapping[str, Any]) -> None:
    """Raise ConfigError unless every key is a real sglang-router flag that slime passes through."""
    flags = router_flags()
    problems: list[str] = []
    for raw in args:
        key = flag_key(str(raw))
        dashed = key.replace("_", "-")
        if key in RESERVED_ROUTER_ARGS:
            problems.append(f"--router-{dashed} cannot be passed through: {RESERVED_ROUTER_ARGS[key]}")
        elif flags is not None and f"--{dashed}" not in flags:
            close = difflib.get_close_matches(f"--{dashed}", sorted(flags), n=1, cutoff=0.6)
            hint = f"; did you mean --router-{close[0][2:]}?" if close else ""
            problems.append(f"--router-{dashed} is not a flag of sglang_router.launch_router{hint}")
    if problems:
        raise ConfigError("invalid router pass-through argument(s):\n  " + "\n  ".join(problems))


def external_engine_urls(addrs: list[str]) -> list[str]:
    """slime's --rollout-external-engine-addrs as base URLs: `host:port` or `http(s)://host:port`."""
    urls = []
    for addr in addrs:
        url = addr.rstrip("/") if "://" in addr else f"http://{addr}"
        host_port = url.split("://", 1)[1]
        host, _, port = host_port.rpartition(":")
        if not host or not port.isdigit() or "/" in host_port:
            raise ConfigError(f"rollout_external_engine_addrs: {addr!r} is not host:port or http://host:port")
        urls.append(url)
    return urls
