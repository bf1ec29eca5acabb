"""Shared test setup: no network, no telemetry, a session-wide tiny kit, and engine clusters."""

import contextlib
import functools
import os
import textwrap
import uuid
from pathlib import Path

import pytest

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def tiny_kit(tmp_path_factory):
    """The tiny model kit built once per test session (tokenizer, Qwen2 model, arithmetic data), from the
    tests' own small recipe (tests/tiny_kit_recipe.yaml), not the larger `make run` default."""
    from slime.data.tiny import load_recipe, make_tiny_kit

    recipe = load_recipe(Path(__file__).with_name("tiny_kit_recipe.yaml"))
    return make_tiny_kit(tmp_path_factory.mktemp("tiny-kit") / "kit", recipe)


@contextlib.contextmanager
def _engine_cluster(model_dir: str, logs: Path, *, engines: int = 2, dtype: str = "auto", **router_options):
    """`engines` built-in engines on `model_dir` (seeds 0, 1, ...) behind the real sglang-router:
    yields (router, [(process, url), ...]); everything is stopped, and checked stopped, on exit."""
    from slime.engines.builtin.launcher import start_builtin_engine
    from slime.engines.router import SGLangRouter

    started, router = [], None
    try:
        for i in range(engines):
            started.append(start_builtin_engine(model_dir, log_path=logs / f"engine{i}.log", random_seed=i,
                                                dtype=dtype))
        router = SGLangRouter(worker_urls=[url for _, url in started], log_path=logs / "router.log",
                              **router_options).start()
        router.wait_workers_healthy(engines, timeout_s=60)
        yield router, started
    finally:
        if router is not None:
            router.stop()
        for process, _ in started:
            process.stop()
    assert not any(process.alive for process, _ in started)
    assert router is None or not router.alive


@pytest.fixture(scope="session")
def engine_cluster(tiny_kit):
    """`engine_cluster(log_dir, engines=2, dtype="auto", **router_options)`: a context manager giving
    built-in engines on the tiny kit behind the real router, for module- or session-scoped fixtures."""
    return functools.partial(_engine_cluster, str(tiny_kit.model_dir))


@pytest.fixture
def make_module(tmp_path, monkeypatch):
    """`make(source)` writes `source` (dedented) as a uniquely named module on sys.path and returns its
    name: a user's plugin module, for dotted-path settings like `<name>.<function>`."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(source: str) -> str:
        name = f"user_module_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return make
