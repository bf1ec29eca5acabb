"""bench/host_cost.py's accounting: the derived rows from synthetic measurements, and the layer hooks' counts and
phases on a tiny HF model (CPU)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import host_cost  # noqa: E402


def test_summary_rows_follow_the_docstring():
    by_layers = {2: {"step": 10_000.0, "fwd": 100.0, "bwd": 150.0, "opt": 1_000.0},
                 4: {"step": 14_000.0, "fwd": 110.0, "bwd": 140.0, "opt": 1_100.0}}
    rows = host_cost.summarize(by_layers, micro_batches=8)
    assert rows["step (2 layers)"] == 10_000 and rows["step (4 layers)"] == 14_000
    assert rows["layer fwd+bwd (diff)"] == pytest.approx(4_000 / (2 * 8))  # per layer and micro-batch
    assert rows["layer fwd"] == 110 and rows["layer bwd"] == 140 and rows["step fixed (optimizer)"] == 1_100
    assert rows["micro-batch fixed"] == pytest.approx((14_000 - 1_100 - 4 * 8 * 250) / 8)


def test_hf_step_is_timed_per_layer_and_optimizer():
    from transformers import Qwen2Config

    config = Qwen2Config(max_position_embeddings=64, num_hidden_layers=3, **host_cost.TINY)
    args = argparse.Namespace(dtype="fp32", micro_batches=2, seq=8, warmup=1, steps=2)
    run = host_cost.hf_runner(config, args)
    timer = host_cost.LayerTimer(run["layers"])
    run["step"]()
    assert timer.calls == 3 * 2  # every layer's forward, once per micro-batch
    assert timer.fwd > 0 and timer.bwd > 0 and timer._bwd_mark is None  # backward reached the first layer's input
    row = host_cost.measure(run, "step", args)
    assert set(row) == {"step", "fwd", "bwd", "opt"}
    assert 0 < row["opt"] < row["step"] and 0 < 3 * 2 * (row["fwd"] + row["bwd"]) < row["step"], row
