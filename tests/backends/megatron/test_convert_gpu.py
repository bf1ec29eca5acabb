"""Conversion parity on CUDA in bf16 for a random Qwen2.5-0.5B-shaped model (pytest -m gpu)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime.data.random_models import save_random_qwen2

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[3]


def test_bf16_conversion_parity_and_export_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    src = save_random_qwen2(tmp_path / "src", "0.5b")
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("roundtrip.py")), "--bf16", str(src),
                             str(tmp_path / "work")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    print(row)
    assert row["names_equal"] and row["bit_exact"]
    assert row["logits_gap"] < 0.25  # bf16: Megatron's local spec and HF's SDPA round differently
