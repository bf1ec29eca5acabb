"""Megatron train steps on CUDA in bf16 for a random Qwen2.5-0.5B-shaped model (pytest -m gpu)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[3]


def test_train_steps_and_export_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=4096)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
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
