"""The rollout manager actor: owns the engines, the router, the data source and the rollout function.

`start()` launches one engine server per engine of the placement (the built-in engine or SGLang, as
`engine.engine` says; on GPUs each with `CUDA_VISIBLE_DEVICES` set to its bundles' GPUs) behind a fresh
sglang-router, then builds slime's flat `args`, the `RolloutDataSource` and the rollout function
(`rollout.rollout_function_path`). `generate(rollout_id)` runs one step and returns the URI of the
committed shard set in the store plus the step's metrics; the trainer reads the samples from the
store, so nothing large travels through Ray. The data-source state (cursor and partial-rollout
buffer) is a JSON dict: the RL loop stores it in the trainer checkpoint's `extra_state` so that both
commit together, and feeds it back with `load_data_source_state` on resume.

`offload`/`onload` release and resume the engines' memory (`/release_memory_occupation`,
`/resume_memory_occupation`); `dispose` stops every process this actor started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from slime.config import Config
from slime.errors import ConfigError

logger = logging.getLogger(__name__)


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able scalar entries of a metrics dict (what crosses Ray)."""
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | str | bool) or v is None}


@contextlib.contextmanager
def _visible_devices(devices: list[int]):
    """`CUDA_VISIBLE_DEVICES` for a child started inside the block (this actor is single-threaded)."""
    if not devices:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class RolloutManager:
    """Run as a Ray actor (`ray.remote(RolloutManager).options(**placement.manager_options())`).

    Args:
        config: `Config.model_dump(mode="json")`.
        engine_devices: GPU ids per engine (`Placement.engine_devices()`); `[[]] * n` on CPU.
        log_dir: where engine and router logs go (default: a new temp dir).
    """

    def __init__(self, config: dict[str, Any], engine_devices: list[list[int]], log_dir: str | None = None) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config = Config.model_validate(config)
        self.engine_devices = engine_devices
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="slime-rollout-"))
        self.engines: list[tuple[Any, str]] = []  # (object with .stop(), url)
        self.router: Any = None
        self.args: Any = None
        self.data_source: Any = None
        self.rollout_fn: Any = None

    def start(self) -> dict[str, Any]:
        """Launch engines and router, build args, data source and rollout function; the URLs."""
        from transformers import AutoTokenizer

        from slime.data.source import RolloutDataSource
        from slime.engines.router import SGLangRouter
        from slime.rollout import load_rollout_function, rollout_args

        c = self.config
        c.require("checkpoint.hf_checkpoint", "run.run_id", stage="rl")
        if not self.engine_devices:
            raise ConfigError("the placement has no engine (rollout_num_gpus 0): the rollout manager needs one")
        t0 = time.monotonic()
        try:
            for i, devices in enumerate(self.engine_devices):
                self.engines.append(self._start_engine(i, devices))
            self.router = SGLangRouter(host=c.engine.sglang_router_ip, port=c.engine.sglang_router_port,
                                       worker_urls=[url for _, url in self.engines], router_args=c.router,
                                       log_path=self.log_dir / "router.log")
            self.router.start()
            self.router.wait_workers_healthy(len(self.engines), timeout_s=120)
        except BaseException:
            self.dispose()
            raise
        self.args = rollout_args(c, self.router)
        tokenizer = AutoTokenizer.from_pretrained(c.checkpoint.hf_checkpoint)
        self.data_source = RolloutDataSource.from_config(c, tokenizer)
        self.rollout_fn = load_rollout_function(self.args)  # signature-checked, as generate_rollout does
        logger.info("rollout manager: %d %s engines behind %s in %.1f s", len(self.engines), c.engine.engine,
                    self.router.url, time.monotonic() - t0)
        return {"router_url": self.router.url, "worker_urls": self.worker_urls(),
                "start_time": time.monotonic() - t0}

    def _start_engine(self, index: int, devices: list[int]) -> tuple[Any, str]:
        from slime.engines.builtin.launcher import start_builtin_engine
        from slime.engines.sglang_server import SGLangEngine

        c = self.config
        log = self.log_dir / f"engine{index}.log"
        if c.engine.engine == "sglang":
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))} if devices else {}
            engine = SGLangEngine(c.checkpoint.hf_checkpoint, sglang_args=c.sglang, log_path=log, env=env).start()
            return engine, engine.url
        with _visible_devices(devices):
            process, url = start_builtin_engine(c.checkpoint.hf_checkpoint, log_path=log,
                                                random_seed=c.run.seed + index)
        return process, url

    def worker_urls(self) -> list[str]:
        return [url for _, url in self.engines]

    # ------------------------------------------------------------------------- rollout

    def generate(self, rollout_id: int) -> tuple[str, dict[str, Any]]:
        """One rollout step; (URI of its committed shard set, its metrics)."""
        from slime.rollout.store import write_rollout

        t0 = time.monotonic()
        out = self.rollout_fn(self.args, rollout_id, self.data_source)
        metrics = dict(out.metrics)
        uri = metrics.get("rollout/uri") or write_rollout(self.args, rollout_id, out.samples, [], _scalars(metrics))
        metrics["rollout/uri"] = uri
        metrics["perf/rollout_time"] = time.monotonic() - t0
        return uri, _scalars(metrics)

    def eval(self, rollout_id: int) -> dict[str, Any]:
        """Evaluate on the eval datasets (`eval.*`); the metrics (the store holds the samples)."""
        t0 = time.monotonic()
        out = self.rollout_fn(self.args, rollout_id, self.data_source, evaluation=True)
        metrics = _scalars(dict(out.metrics))
        metrics["perf/eval_time"] = time.monotonic() - t0
        return metrics

    def data_source_state(self) -> dict[str, Any]:
        """The data source's cursor and partial-rollout buffer, as JSON."""
        return self.data_source.state_dict()

    def load_data_source_state(self, state: dict[str, Any]) -> None:
        """Restore a state from `data_source_state` (checked against this dataset and settings)."""
        self.data_source.load_state_dict(state)

    # ------------------------------------------------------------------------- memory, shutdown

    def _broadcast(self, path: str) -> dict[str, Any]:
        from slime.engines.client import EngineClient
        from slime.engines.router import broadcast_to_workers

        async def send() -> dict[str, Any]:
            async with EngineClient() as client:
                return await broadcast_to_workers(client, self.worker_urls(), path, {})

        return asyncio.run(send())

    def offload(self) -> dict[str, Any]:
        """Release every engine's memory (weights and KV cache) while the trainer runs."""
        t0 = time.monotonic()
        self._broadcast("/release_memory_occupation")
        return {"perf/offload_rollout_time": time.monotonic() - t0}

    def onload(self) -> dict[str, Any]:
        """Resume every engine's memory after `offload`."""
        t0 = time.monotonic()
        self._broadcast("/resume_memory_occupation")
        return {"perf/onload_rollout_time": time.monotonic() - t0}

    def dispose(self) -> None:
        """Stop the router and every engine this actor started (idempotent)."""
        if self.router is not None:
            self.router.stop()
            self.router = None
        for engine, _ in reversed(self.engines):
            engine.stop()
        self.engines = []
