"""train.fp32_logits: scoring a bf16 model's logits in bf16 (no fp32 upcast of the whole [B, S, V] tensor) gives
the same log-probs, losses and gradients bit for bit as megatron's fp32 upcast (bench/op_census.py measures the
bytes it saves)."""

import pytest
from script_rows import rows_by_case, run_script


@pytest.fixture(scope="module")
def rows(tiny_kit):
    return rows_by_case(run_script("logits_dtype_parity.py", tiny_kit.model_dir, timeout=600))


def test_the_option_reaches_the_model_output(rows):
    # Float16Module upcasts unless told not to: the option changes what the scorer reads
    assert rows["compute_log_probs"]["dtypes"] == {"True": "torch.float32", "False": "torch.bfloat16"}


def test_log_probs_and_entropies_are_identical(rows):
    row = rows["compute_log_probs"]
    assert row["identical"] and row["max_gap"] == 0.0, row


@pytest.mark.parametrize("case", ["sft", "policy with entropy"])
def test_train_step_losses_and_gradients_are_identical(rows, case):
    row = rows[case]
    assert row["grads_nonzero"] == row["params"], row  # every parameter got a gradient to compare
    assert row["grads_identical"], row
    assert row["loss_fp32"] == row["loss_bf16"] and row["grad_norm"] == row["grad_norm_bf16"], row
