"""The SDPA core attention computes what megatron-core's unfused DotProductAttention computes."""

import pytest
from script_rows import rows_by_case, run_script


@pytest.fixture(scope="module")
def rows(tiny_kit):
    return rows_by_case(run_script("attention_parity.py", tiny_kit.model_dir, timeout=600))


@pytest.mark.parametrize("case", ["causal MHA", "causal GQA 4:2", "explicit mask GQA"])
def test_sdpa_matches_megatron_attention(rows, case):
    row = rows[case]
    assert row["same_shape"] and row["shape"] == [11, 3, 64], row
    assert row["out_gap"] < 1e-5 and row["grad_gap"] < 1e-5, row  # fp32 rounding of two kernels


def test_bridged_models_use_sdpa(rows):
    assert rows["bridged model"]["attention_modules"] == ["SDPAttention", "SelfAttention"]
