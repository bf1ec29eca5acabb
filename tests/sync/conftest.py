"""Two built-in engines behind the real sglang-router, shared by the sync tests of one module."""

import httpx
import pytest

from slime.engines.builtin.launcher import start_builtin_engine
from slime.engines.router import SGLangRouter


@pytest.fixture(scope="module")
def cluster(tiny_kit, tmp_path_factory):
    logs = tmp_path_factory.mktemp("sync-cluster")
    engines, router = [], None
    try:
        for i in range(2):
            engines.append(start_builtin_engine(str(tiny_kit.model_dir), log_path=logs / f"engine{i}.log",
                                                random_seed=i, dtype="float32"))
        router = SGLangRouter(worker_urls=[url for _, url in engines], log_path=logs / "router.log").start()
        router.wait_workers_healthy(2, timeout_s=60)
        yield router, [url for _, url in engines]
    finally:
        if router is not None:
            router.stop()
        for process, _ in engines:
            process.stop()
    assert not any(process.alive for process, _ in engines)


@pytest.fixture
def http():
    with httpx.Client(timeout=120, trust_env=False) as client:
        yield client
