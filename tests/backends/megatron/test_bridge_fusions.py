"""megatron's fused SwiGLU (`bias_activation_fusion`, on where CUDA has Triton) gives the unfused
model's logits and gradients; on CPU the bridge leaves it off. The two scripts run two at a time
(script_rows.run_scripts)."""

import pytest
from script_rows import run_scripts


@pytest.fixture(scope="module")
def runs(tiny_kit):
    """Each script's rows, as a Future (a failed script fails the test that reads it, not the other)."""
    return run_scripts({script: (script, tiny_kit.model_dir) for script in ("fusion_parity.py", "negated_flags.py")},
                       timeout=300)


def test_fused_swiglu_matches_the_unfused_model(runs):
    row = runs["fusion_parity.py"].result()[0]
    assert row["fused_flag"] and not row["plain_flag"], row  # the option reached the model's config
    assert row["fused_calls"] > 0 and row["plain_calls"] == 0, row  # and the fused kernel ran
    assert row["logit_gap"] < 1e-6 * row["logit_scale"], row
    assert row["grad_gap"] < 1e-6, row
    assert row["available"] is False  # CPU: the bridge keeps it off by default


def test_megatron_no_fusion_flags_turn_the_fusions_off_in_the_model(runs):
    """slime command lines carry Megatron-LM's --no-rope-fusion & co.; each reaches the built model's
    TransformerConfig as its field set False, over the bridge's defaults (on where CUDA has Triton)."""
    row = runs["negated_flags.py"].result()[0]
    # the defaults the bridge gives a CUDA machine with Triton: the three fusions with torch providers on
    assert row["default"]["gradient_accumulation_fusion"] and row["default"]["apply_rope_fusion"], row
    assert row["default"]["bias_activation_fusion"], row
    assert row["megatron"] == {field: False for field in row["flagged"]}, row
    assert not any(row["flagged"].values()), row
