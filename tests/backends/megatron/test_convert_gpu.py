"""Conversion parity on CUDA in bf16 for a random Qwen2.5-0.5B-shaped model (pytest -m gpu)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime.data.tiny import build_tokenizer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[3]


def test_bf16_conversion_parity_and_export_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=4096)
    src = tmp_path / "src"
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(src)
    build_tokenizer().save_pretrained(src)
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("roundtrip.py")), "--bf16", str(src),
                             str(tmp_path / "work")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    print(row)
    assert row["names_equal"] and row["bit_exact"]
    assert row["logits_gap"] < 0.25  # bf16: Megatron's local spec and HF's SDPA round differently
