"""Two built-in engines behind the real sglang-router, shared by the sync tests of one module."""

import httpx
import pytest


@pytest.fixture(scope="module")
def cluster(engine_cluster, tmp_path_factory):
    with engine_cluster(tmp_path_factory.mktemp("sync-cluster"), dtype="float32") as (router, engines):
        yield router, [url for _, url in engines]


@pytest.fixture
def http():
    with httpx.Client(timeout=120, trust_env=False) as client:
        yield client
