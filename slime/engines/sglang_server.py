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

import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from slime.config.engine_flags import check_sglang_args, flag_key, flags_to_argv
from slime.engines.process import ServerProcess, local_host, server_url, start_server
from slime.net import find_free_port

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health_generate"

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
