"""Start a built-in engine server as a child process and wait until it can generate."""

from __future__ import annotations

import sys
from pathlib import Path

from slime.engines.process import ServerProcess, local_host, server_url, start_server
from slime.net import find_free_port


def start_builtin_engine(
    model_path: str,
    *,
    log_path: str | Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    random_seed: int = 0,
    max_running_requests: int = 256,
    kv_cache: str = "auto",
    timeout_s: float = 180.0,
    extra_args: list[str] | tuple[str, ...] = (),
) -> tuple[ServerProcess, str]:
    """Launch `python -m slime.engines.builtin` on a free port; return the process and its URL.

    The process is stopped again if it does not answer `/health_generate` within `timeout_s`.
    `extra_args` are more server flags (`python -m slime.engines.builtin --help`).
    """
    port = port or find_free_port(local_host(host))
    cmd = [sys.executable, "-m", "slime.engines.builtin", "--model", model_path, "--host", host,
           "--port", str(port), "--device", device, "--dtype", dtype, "--random-seed", str(random_seed),
           "--max-running-requests", str(max_running_requests), "--kv-cache", kv_cache, *extra_args]
    url = server_url(host, port)  # a wildcard bind (0.0.0.0) is reached at 127.0.0.1 here
    process = start_server(cmd, log_path=log_path, health_url=f"{url}/health_generate", timeout_s=timeout_s,
                           name=f"builtin-engine:{port}")
    return process, url
