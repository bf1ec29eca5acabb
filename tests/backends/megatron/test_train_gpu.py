"""Megatron train steps on CUDA in bf16 for a random Qwen2.5-0.5B-shaped model (pytest -m gpu)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime.data.random_models import save_random_qwen2

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[3]


def test_train_steps_and_export_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    save_random_qwen2(tmp_path / "hf", "0.5b")
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("train_gpu.py")), str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    print(row)
    losses = row["sft_losses"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses  # repeated batch at lr 1e-4: the loss falls clearly
    assert math.isfinite(row["policy"]["grad_norm"]) and row["policy"]["update_successful"] == 1.0
    assert row["export_matches_hf"] and row["exported_tensors"] == 290
