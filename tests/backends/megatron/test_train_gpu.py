"""Megatron train steps on CUDA in bf16 for a random Qwen2.5-0.5B-shaped model (pytest -m gpu)."""

import math

import pytest
import torch
from script_rows import run_script

from slime.data.random_models import save_random_qwen2

pytestmark = pytest.mark.gpu


def test_train_steps_and_export_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    save_random_qwen2(tmp_path / "hf", "0.5b")
    row = run_script("train_gpu.py", tmp_path / "hf", timeout=900)[0]
    print(row)
    losses = row["sft_losses"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses  # repeated batch at lr 1e-4: the loss falls clearly
    assert math.isfinite(row["policy"]["grad_norm"]) and row["policy"]["update_successful"] == 1.0
    assert row["export_matches_hf"] and row["exported_tensors"] == 290
