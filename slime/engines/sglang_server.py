"""Launch real SGLang servers (`python -m sglang.launch_server`) with validated pass-through flags.

Every `--sglang-<flag>` a user sets reaches the `sglang:` config section as `{flag_underscored: value}`
and is forwarded verbatim to each engine. Before anything starts, `check_sglang_args` makes sure each
key is a real SGLang flag, so a typo fails at config time with a suggestion instead of killing an
engine minutes into a GPU job. The reference is the installed SGLang (its `ServerArgs` fields and CLI
parser) when it can be imported, else the flag list of the pinned version in `sglang_flags.txt`.

A few flags are owned by the launcher (model path, bind address, port) and are rejected as
pass-through, with the config field that controls them. SGLang needs CUDA, so on CPU machines only
the command building and validation here can run; `SGLangEngine` is exercised on GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Self

from slime.engines.process import (
    ServerProcess,
    find_free_port,
    flag_key,
    flags_to_argv,
    local_host,
    server_url,
    start_server,
)
from slime.errors import ConfigError

logger = logging.getLogger(__name__)

PINNED_SGLANG_VERSION = "0.5.23"
HEALTH_PATH = "/health_generate"

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
    text = resources.files("slime.engines").joinpath("sglang_flags.txt").read_text(encoding="utf-8")
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


def build_sglang_command(model_path: str | os.PathLike[str], host: str, port: int,
                         sglang_args: Mapping[str, Any] | None = None,
                         python: str = sys.executable) -> list[str]:
    """`[python, -m, sglang.launch_server, --model-path, M, --host, H, --port, P, <pass-through>...]`.

    Pass-through values: True -> bare flag, False/None -> omitted, list -> the flag then every value,
    dict -> JSON, else the value as a string. Keys are validated first (`check_sglang_args`).
    """
    args = {flag_key(str(k)): v for k, v in (sglang_args or {}).items()}
    check_sglang_args(args)
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--host", host, "--port", str(port), *flags_to_argv(args)]


class SGLangEngine:
    """One SGLang server process: start, wait until `/health_generate` answers, stop (whole group)."""

    def __init__(self, model_path: str | os.PathLike[str], *, sglang_args: Mapping[str, Any] | None = None,
                 host: str = "127.0.0.1", port: int | None = None,
                 log_path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                 python: str = sys.executable, startup_timeout_s: float = 1800.0) -> None:
        self.model_path = str(model_path)
        self.sglang_args = dict(sglang_args or {})
        check_sglang_args(self.sglang_args)
        self.host = host
        self.port = port
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = dict(env or {})
        self.python = python
        self.startup_timeout_s = startup_timeout_s
        self.process: ServerProcess | None = None

    @property
    def url(self) -> str:
        """Base URL of the server (`http://host:port`); set once `start()` picked the port."""
        if self.port is None:
            raise RuntimeError("SGLangEngine has no port yet: call start() first")
        return server_url(self.host, self.port)

    def command(self) -> list[str]:
        """The launch command (picks a free port first if none was given)."""
        if self.port is None:
            self.port = find_free_port(local_host(self.host))
        return build_sglang_command(self.model_path, self.host, self.port, self.sglang_args, self.python)

    def start(self) -> Self:
        """Launch the server and wait for `GET /health_generate` 200; on failure stop it and raise."""
        cmd = self.command()
        log_path = self.log_path or Path(tempfile.gettempdir()) / f"slime-sglang-{self.port}.log"
        self.process = start_server(cmd, log_path=log_path, health_url=self.url + HEALTH_PATH,
                                    timeout_s=self.startup_timeout_s, interval_s=2.0, env=self.env,
                                    name=f"sglang@{self.port}")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server and every process it forked (idempotent)."""
        if self.process is not None:
            self.process.stop(timeout_s=timeout_s)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
