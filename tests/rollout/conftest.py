"""Rollout test setup: two built-in engines behind the real sglang-router, shared by the rollout test
modules (session scope); tests that kill engines get a module-scoped cluster of their own."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from slime.config import FIELD_SECTION, Config
from slime.rollout import rollout_args

# `examples/` is a top-level directory of the repository, not an installed package: make it importable
# as `examples.<module>` (plugin paths in the tests name it so, as a user running from the root would).
REPO_ROOT = str(Path(__file__).resolve().parents[2])
if REPO_ROOT not in sys.path:
    sys.path.append(REPO_ROOT)


@pytest.fixture(scope="session")
def cluster(engine_cluster, tmp_path_factory):
    """Two engines behind the router, shared by every rollout test module (none of them stops it)."""
    with engine_cluster(tmp_path_factory.mktemp("rollout-cluster"), health_check_interval_secs=1) as running:
        yield running


@pytest.fixture(scope="module")
def doomed_cluster(engine_cluster, tmp_path_factory):
    """A module's own cluster, for tests that kill its engines."""
    with engine_cluster(tmp_path_factory.mktemp("doomed-cluster"), health_check_interval_secs=1) as running:
        yield running


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
