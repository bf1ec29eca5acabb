"""Prefect settings for task tests: a private PREFECT_HOME, no telemetry (set before prefect is imported)."""

import os
import tempfile
from pathlib import Path

import pytest

TINY_CPU = Path(__file__).resolve().parents[2] / "deployments" / "tiny-cpu.yaml"

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="slime-test-prefect-home-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="module")
def kit_config(tiny_kit):
    """deployments/tiny-cpu.yaml pointed at the session's tiny kit, with a one-step SFT."""
    from slime.config import load_config

    return load_config(str(TINY_CPU), [
        "--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]", "--sft-num-epoch", "1",
        "--prompt-data", str(tiny_kit.train), "--rs-prompt-data", f"{tiny_kit.train}@[0:32]",
        "--eval-prompt-data", "arithmetic", str(tiny_kit.eval)])
