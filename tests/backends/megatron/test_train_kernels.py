"""The issue-17 kernels together (fused AdamW, gradient-accumulation fusion, rotary fusion, compiled scoring;
CUDA's defaults)
train the tiny model like the unfused path: three Adam steps through `train_step`, fp32 on CPU."""

from script_rows import run_script


def test_train_steps_with_the_fused_kernels_match_the_unfused_ones(tiny_kit):
    row = run_script("kernel_parity.py", tiny_kit.model_dir, timeout=600)[0]
    assert row["on_flags"] == {"grad_accum_fusion": True, "rope_fusion": True, "fused_adam": True,
                               "compiled_scores": True}, row
    assert row["off_flags"] == {"grad_accum_fusion": False, "rope_fusion": False, "fused_adam": False,
                                "compiled_scores": False}, row
    assert row["off_calls"] == {"wgrad": 0, "rope": 0, "scores": 0}, row
    assert row["on_calls"]["wgrad"] > 0 and row["on_calls"]["rope"] > 0, row
    assert row["on_calls"]["scores"] > 0, row  # the scoring chunks ran compiled (forward and backward)
    assert row["moved"] > 1e-3, row  # every weight moves (Adam at lr 1e-2, eps 1e-3, three steps)
    assert row["weight_gap"] < 1e-6, row  # measured 1.4e-7
    for on, off in zip(row["on_losses"], row["off_losses"], strict=True):
        assert abs(on - off) < 1e-6, row
