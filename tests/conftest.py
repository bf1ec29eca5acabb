"""Shared test setup: no network, no telemetry, and a session-wide tiny kit."""

import os

import pytest

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def tiny_kit(tmp_path_factory):
    """The tiny model kit built once per test session (tokenizer, Qwen2 model, arithmetic data)."""
    from slime.data.tiny import make_tiny_kit

    return make_tiny_kit(tmp_path_factory.mktemp("tiny-kit") / "kit")
