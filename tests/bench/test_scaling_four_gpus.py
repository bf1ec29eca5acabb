"""The arithmetic of docs/scaling.md, "What fits on four H100s" (bench/scaling.py), against values worked out by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import scaling  # noqa: E402

GIB = 2**30
N_7B = 7_615_616_512  # what the 7B kit's writer counts (tests/data/test_kit_drawn.py builds that config)


def test_the_7b_shape_by_hand():
    s = scaling.SHAPES["7B"]
    # a layer: q 3584^2 + 3584, k and v 2 (3584 x 512 + 512), o 3584^2, MLP 3 x 3584 x 18944, two norms 2 x 3584
    layer = (3584**2 + 3584) + 2 * (3584 * 512 + 512) + 3584**2 + 3 * 3584 * 18944 + 2 * 3584
    assert layer == 233_057_792
    assert s.params == 28 * layer + 2 * 152064 * 3584 + 3584 == N_7B
    assert s.activation_bytes_per_token_layer() == 14 * 3584 + 4 * 512 + 6 * 18944 == 165_888
    assert s.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2 == 57_344  # 56 KiB, deployments/gpu-7b-x4.yaml


def test_a_tp2_dp2_rank_of_the_7b_by_hand():
    parts = scaling.train_gib(scaling.SHAPES["7B"], tp=2, pp=1, dp=2, tokens=4096)
    assert parts["weights"] == pytest.approx(2 * N_7B / 2 / GIB)  # 7.09 GiB
    assert parts["gradients"] == pytest.approx(4 * N_7B / 2 / GIB)  # 14.19
    assert parts["optimizer"] == pytest.approx(12 * N_7B / 2 / 2 / GIB)  # 21.28: sharded over DP 2
    # full recompute: 28 layer inputs (2 x 3584 B a token, / TP 2) + one layer's set (165,888 B a token / 2)
    assert parts["activations"] * GIB == pytest.approx(28 * 4096 * 3584 + 4096 * 165_888 / 2)  # 0.70 GiB
    assert parts["logits"] * GIB == pytest.approx(4096 * 152064 / 2 * 6)  # 1.74 GiB
    no_recompute = scaling.train_gib(scaling.SHAPES["7B"], 2, 1, 2, tokens=4096, recompute=False)
    assert no_recompute["activations"] * GIB == pytest.approx(28 * 4096 * 165_888 / 2)  # 8.86 GiB
    lora = scaling.train_gib(scaling.SHAPES["7B"], 2, 1, 2, lora=True)
    assert lora["gradients"] == lora["optimizer"] == 0 and lora["weights"] == parts["weights"]


def test_the_7b_engine_by_hand():
    engine = scaling.engine_gib(scaling.SHAPES["7B"], engine_tp=1, requests=128, context=2048)
    assert engine == {"weights": pytest.approx(2 * N_7B / GIB), "kv cache": 14.0}  # 128 x 2048 x 56 KiB


def test_what_fits_on_four_gpus():
    shapes = scaling.SHAPES
    assert scaling.four_gpu_fit(shapes["7B"])[0] == (2, 1, 2)  # the deployment's layout
    layout, peak = scaling.four_gpu_fit(shapes["14B"])
    assert layout == (4, 1, 1) and 60 < peak < scaling.USABLE_GIB  # full 14B: TP 4, DP 1, tight
    assert scaling.four_gpu_fit(shapes["32B"])[1] > 1.7 * scaling.USABLE_GIB  # full 32B: 139 GiB, no layout fits
    assert scaling.four_gpu_fit(shapes["72B"], lora=True) == ((4, 1, 1), pytest.approx(36.3, abs=0.1))
    table = "\n".join(scaling.four_gpu_table())
    assert "| 32B | 32.76B | full |" in table and table.count("| no |") == 2  # full 32B and 72B
