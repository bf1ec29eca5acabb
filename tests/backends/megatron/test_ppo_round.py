"""One PPO round through the trainer's public API on the tiny kit (fp32 CPU): reference and old
log-probs, critic values, GAE advantages whitened over DP, two actor steps and three critic steps."""

import math

from script_rows import run_script


def test_ppo_round(tiny_kit):
    row = run_script("ppo_round.py", tiny_kit.model_dir, timeout=600)[0]
    first, second = row["actor"]
    # old log-probs are the actor's own before the first step: ratio 1, nothing clipped
    assert abs(first["ppo_kl"]) < 1e-6 and first["pg_clipfrac"] == 0.0, first
    # the second step sees the moved policy against the same old log-probs
    assert second["ppo_kl"] > 1e-4 and second["pg_clipfrac"] > 0, second
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in row["actor"] + row["critic"])
    losses = [s["value_loss"] for s in row["critic"]]
    assert losses[-1] < losses[0], losses
    assert abs(row["advantage_mean"]) < 1e-6  # whitened
