"""An engine on another node than its fleet: a small Ray actor there starts and stops its server process.

The rollout manager (and its router) may run on the driver's node while engines run on others
(`slime.ray.placement`: engine bundles on other nodes). A child process can only be started on the
node of the process that starts it, so each remote engine gets an `EngineHost` actor placed in the
engine's own bundle: it runs `launch_engine` there (the same start-up as a local engine) and keeps the
server; the fleet holds a `RemoteEngine`, which stops it through the actor. The engine's URL uses its
node's IP when `engine.engine_host` is a wildcard, so the router reaches it across nodes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from slime.config import Config
from slime.engines.launch import launch_engine


class EngineHost:
    """Ray actor on an engine's node: `launch` its server (one at a time), `stop` it."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = Config.model_validate(config)
        self.server: Any = None

    def launch(self, model_dir: str, log_path: str, index: int, devices: list[int]) -> tuple[str, int | None]:
        """Start engine `index` on this node (stopping the one this host ran before); its (URL, PID)."""
        self.stop()
        path = Path(log_path)
        path.parent.mkdir(parents=True, exist_ok=True)  # the fleet's log directory is on another node

        def keep(server: Any) -> None:
            self.server = server

        url = launch_engine(self.config, model_dir, path, index, devices, keep)
        process = getattr(self.server, "process", self.server)
        return url, getattr(process, "pid", None)

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the engine this host started (idempotent)."""
        if self.server is not None:
            if timeout_s is None:
                self.server.stop()
            else:
                self.server.stop(timeout_s=timeout_s)
            self.server = None

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RemoteEngine:
    """The fleet's handle of an engine an `EngineHost` runs: its PID (on that node) and `stop`."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.pid: int | None = None

    def stop(self, timeout_s: float | None = None) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError):  # the host (and its node) gone: nothing to stop
            ray.get(self.host.stop.remote(timeout_s))
