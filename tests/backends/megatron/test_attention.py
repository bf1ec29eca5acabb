"""The SDPA core attention computes what megatron-core's unfused DotProductAttention computes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def rows(tiny_kit):
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("attention_parity.py")),
                             str(tiny_kit.model_dir)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return {row["case"]: row for row in map(json.loads, filter(lambda s: s.startswith("{"), result.stdout.splitlines()))}


@pytest.mark.parametrize("case", ["causal MHA", "causal GQA 4:2", "explicit mask GQA"])
def test_sdpa_matches_megatron_attention(rows, case):
    row = rows[case]
    assert row["same_shape"] and row["shape"] == [11, 3, 64], row
    assert row["out_gap"] < 1e-5 and row["grad_gap"] < 1e-5, row  # fp32 rounding of two kernels


def test_bridged_models_use_sdpa(rows):
    assert rows["bridged model"]["attention_modules"] == ["SDPAttention", "SelfAttention"]
