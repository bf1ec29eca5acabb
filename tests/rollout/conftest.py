"""Rollout test setup: two built-in engines behind the real sglang-router, shared by the rollout test
modules (session scope); tests that kill engines get a module-scoped cluster of their own."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from slime.config import FIELD_SECTION, Config
from slime.engines.builtin.launcher import start_builtin_engine
from slime.engines.router import SGLangRouter
from slime.rollout import rollout_args

# `examples/` is a top-level directory of the repository, not an installed package: make it importable
# as `examples.<module>` (plugin paths in the tests name it so, as a user running from the root would).
REPO_ROOT = str(Path(__file__).resolve().parents[2])
if REPO_ROOT not in sys.path:
    sys.path.append(REPO_ROOT)


def _cluster(tiny_kit, logs):
    """(router, [(process, url), (process, url)]): stopped, and checked stopped, afterwards."""
    engines = []
    router = None
    try:
        for i in range(2):
            engines.append(start_builtin_engine(str(tiny_kit.model_dir), log_path=logs / f"engine{i}.log",
                                                random_seed=i))
        router = SGLangRouter(worker_urls=[url for _, url in engines], health_check_interval_secs=1,
                              log_path=logs / "router.log").start()
        router.wait_workers_healthy(2, timeout_s=60)
        yield router, engines
    finally:
        if router is not None:
            router.stop()
        for process, _ in engines:
            process.stop()
    assert not any(process.alive for process, _ in engines)
    assert router is None or not router.alive


@pytest.fixture(scope="session")
def cluster(tiny_kit, tmp_path_factory):
    """Two engines behind the router, shared by every rollout test module (none of them stops it)."""
    yield from _cluster(tiny_kit, tmp_path_factory.mktemp("rollout-cluster"))


@pytest.fixture(scope="module")
def doomed_cluster(tiny_kit, tmp_path_factory):
    """A module's own cluster, for tests that kill its engines."""
    yield from _cluster(tiny_kit, tmp_path_factory.mktemp("doomed-cluster"))


def engine_requests(engines) -> list[int]:
    """Requests each engine holds right now (running + waiting), from its own /get_load."""
    with httpx.Client(timeout=30, trust_env=False) as http:
        return [http.get(f"{url}/get_load").json()[0]["num_reqs"] for _, url in engines]


def args_for(router, tiny_kit, **fields: Any):
    """slime's flat `args` for a rollout against `router`: small defaults, `fields` (flat names) on top."""
    nested: dict[str, dict[str, Any]] = {}
    defaults = {"hf_checkpoint": str(tiny_kit.model_dir), "prompt_data": str(tiny_kit.train),
                "rollout_batch_size": 4, "n_samples_per_prompt": 2, "rollout_max_response_len": 6,
                "sglang_server_concurrency": 8}
    for name, value in {**defaults, **fields}.items():
        nested.setdefault(FIELD_SECTION[name], {})[name] = value
    return rollout_args(Config.model_validate(nested), router)


@pytest.fixture
def make_args(tiny_kit, cluster):
    """`make_args(**flat_fields)`: slime's flat `args` for a rollout against the shared cluster."""
    return lambda **fields: args_for(cluster[0], tiny_kit, **fields)
