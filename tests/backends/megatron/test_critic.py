"""The PPO critic: Megatron GPTModel with a 1-output value head, against the same critic written by hand
on the HF backbone (fp32, CPU): forward values, one clipped value-loss step, and training lowers the loss."""

import pytest
from script_rows import rows_by_case, run_script


@pytest.fixture(scope="module")
def rows(tiny_kit):
    return rows_by_case(run_script("value_parity.py", tiny_kit.model_dir, timeout=600))


def test_values_match_hand_written_critic(rows):
    row = rows["values"]
    assert row["head_shape"] == [1, 128]  # hidden -> 1, not tied to the embedding
    assert row["lengths"] == [6, 2, 8, 5, 3, 7]
    assert row["spread"] > 1e-2, row  # real, varying values
    assert row["gap"] < 1e-5, row


def test_value_step_matches_hand_written_step(rows):
    row = rows["value step"]
    assert abs(row["megatron_loss"] - row["hf_loss"]) < 1e-6, row
    assert 0 < row["value_clipfrac"] < 1 and abs(row["value_clipfrac"] - row["hf_clipfrac"]) < 1e-6, row
    assert row["head_moved"] > 1e-3 and row["head_gap"] < 1e-6, row
    # values after the step (every weight contributes) agree to fp32 rounding
    assert row["values_moved"] > 1e-2 and row["values_gap"] < 1e-5, row


def test_value_training_lowers_value_loss(rows):
    losses = rows["value training"]["losses"]
    assert losses[-1] < 0.2 * losses[0], losses


def test_critic_checkpoint_resumes_exactly(rows):
    row = rows["critic checkpoint"]
    assert row["fresh_gap"] > 1e-3, row  # a fresh critic (new random head) differs...
    assert row["loaded_gap"] == 0.0, row  # ...until it loads the checkpoint
    assert row["resumed_loss"] == row["next_loss"], row  # optimizer state restored: the same next step
