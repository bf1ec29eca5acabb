"""A short-lived engine fleet for stages that sample from one fixed policy (rejection sampling, evaluate).

`policy_hf_dir` turns the policy into something an engine can load: an HF directory is served as is, a
Megatron checkpoint (or a `--save` root: its newest committed iteration) is exported to HF once, at a
location the caller names, and that export is reused while it comes from the same checkpoint.
`serve_policy` starts `num_engines` engines (built-in or SGLang, `engine.engine`) behind a fresh
sglang-router and stops everything it started when the block ends, also on errors. The RL loop keeps its
engines for the whole run instead (`slime.ray.rollout_manager`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from slime.config import Config
from slime.engines.router import SGLangRouter
from slime.errors import ConfigError

logger = logging.getLogger(__name__)


def is_hf_dir(path: str) -> bool:
    """True for a local HF model directory (it has a config.json)."""
    return os.path.isfile(os.path.join(path, "config.json"))


def policy_hf_dir(config: Config, source: str, export_uri: str) -> str:
    """An HF directory to serve for `source`: itself when it is one, else its export at `export_uri`.

    The export is made once: a committed export of the same checkpoint is reused, one of another
    checkpoint is refused (ConfigError) rather than overwritten. No committed checkpoint under `source`
    raises NotCommittedError naming it.
    """
    from slime.export import resolve_checkpoint, run_export
    from slime.storage import is_committed, read_manifest

    if is_hf_dir(source):
        return source
    checkpoint = resolve_checkpoint(source)
    if is_committed(export_uri):
        if read_manifest(export_uri).metadata.get("source_checkpoint") == checkpoint:
            return export_uri
        raise ConfigError(f"{export_uri} holds the export of another checkpoint than {checkpoint}; choose "
                          "another output name or run_id")
    export_config = config.model_copy(deep=True)
    export_config.checkpoint.load = checkpoint
    export_config.export.output_dir = export_uri
    export_config.export.origin_hf_dir = config.export.origin_hf_dir or config.checkpoint.hf_checkpoint
    logger.info("exporting %s to %s for serving", checkpoint, export_uri)
    return run_export(export_config)["hf_dir"]


@contextlib.contextmanager
def serve_policy(config: Config, model_dir: str, log_dir: Path, num_engines: int) -> Iterator[SGLangRouter]:
    """`num_engines` engines for `model_dir` behind a new router (yielded, healthy); all stopped on exit."""
    from slime.engines.builtin.launcher import start_builtin_engine
    from slime.engines.sglang_server import SGLangEngine

    stops: list[Callable[[], None]] = []
    router = None
    try:
        urls = []
        for i in range(num_engines):
            log_path = log_dir / f"engine{i}.log"
            if config.engine.engine == "sglang":
                engine = SGLangEngine(model_dir, sglang_args=config.sglang, log_path=log_path)
                stops.append(engine.stop)
                urls.append(engine.start().url)
            else:
                process, url = start_builtin_engine(model_dir, log_path=log_path, random_seed=config.run.seed + i)
                stops.append(process.stop)
                urls.append(url)
        router = SGLangRouter(host=config.engine.sglang_router_ip, port=config.engine.sglang_router_port,
                              worker_urls=urls, router_args=config.router, log_path=log_dir / "router.log")
        router.start()
        router.wait_workers_healthy(num_engines, timeout_s=120)
        yield router
    finally:
        if router is not None:
            router.stop()
        for stop in reversed(stops):
            stop()
