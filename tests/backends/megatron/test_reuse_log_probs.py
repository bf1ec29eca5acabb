"""Skipping the old-log-prob pass (slime's can_reuse_log_probs_in_loss): when it applies, and that a rank which
skips it trains and reports exactly what the recompute path does (reuse_log_probs.py, fp32 on CPU; its two
cases run two at a time, script_rows.run_scripts)."""

import pytest
from script_rows import rows_by_case, run_scripts

from slime.backends.megatron.hooks import MegatronHooks
from slime.config import Config
from slime.ray.train_data import can_reuse_log_probs, reused_log_prob_stats

SAME = ("train/loss", "train/grad_norm", "train/pg_loss", "train/kl_loss", "train/pg_clipfrac",
        "train/train_rollout_logprob_abs_diff", "rollout/log_probs", "rollout/kl", "rollout/entropy",
        "rollout/advantages")


def config(**algorithm) -> Config:
    return Config.model_validate({"rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 4},
                                  "algorithm": algorithm})


def test_the_pass_is_skipped_only_for_one_policy_step_that_nothing_else_reads_it_for():
    hooks = MegatronHooks()
    assert can_reuse_log_probs(config(), 1, hooks)
    assert can_reuse_log_probs(config(use_kl_loss=True, kl_loss_coef=0.1, use_tis=True), 1, hooks)
    assert not can_reuse_log_probs(config(), 2, hooks)  # the second step's ratio needs the rollout's policy
    for excluded in ({"kl_coef": 0.1}, {"use_rollout_logprobs": True}, {"get_mismatch_metrics": True},
                     {"keep_old_actor": True}, {"advantage_estimator": "gspo"}, {"loss_type": "sft_loss"}):
        assert not can_reuse_log_probs(config(**excluded), 1, hooks), excluded
    correct = Config.model_validate({"run": {"log_correct_samples": True}})
    assert not can_reuse_log_probs(correct, 1, hooks)
    for hook in ("advantage", "rollout_data_postprocess"):  # they are given the old log-probs
        assert not can_reuse_log_probs(config(), 1, MegatronHooks(**{hook: print}))
    assert can_reuse_log_probs(config(), 1, MegatronHooks(before_train_step=print))


def test_reused_stats_are_token_means_of_the_steps_sums():
    row = {"loss": 1.0, "reused_log_probs/tokens": 4.0, "reused_log_probs/log_probs": -8.0,
           "reused_log_probs/entropy": 6.0, "reused_log_probs/abs_diff": 1.5, "reused_log_probs/abs_diff_tokens": 3.0,
           "reused_log_probs/kl": 0.4}
    stats = reused_log_prob_stats(row, with_kl=True, with_entropy=True)
    assert stats == {"rollout/log_probs": -2.0, "train/train_rollout_logprob_abs_diff": 0.5, "rollout/kl": 0.1,
                     "rollout/entropy": 1.5}
    assert row == {"loss": 1.0}  # the sums are not step metrics
    row = {"reused_log_probs/tokens": 4.0, "reused_log_probs/log_probs": -8.0, "reused_log_probs/entropy": 6.0,
           "reused_log_probs/abs_diff": 0.0, "reused_log_probs/abs_diff_tokens": 0.0}
    assert reused_log_prob_stats(row, with_kl=False, with_entropy=False) == {"rollout/log_probs": -2.0}


@pytest.fixture(scope="module")
def runs(tiny_kit, tmp_path_factory):
    """Each case's rows, as a Future (a failed script fails the test that reads it, not the other)."""
    return run_scripts({case: ("reuse_log_probs.py", tiny_kit.model_dir, tmp_path_factory.mktemp(case), case)
                        for case in ("reuse", "kl-coef")}, timeout=600)


def test_a_rank_that_skips_the_pass_trains_and_reports_as_the_recompute_path(runs):
    rows = rows_by_case(runs["reuse"].result())
    first, recompute, reuse, two = rows["first"], rows["recompute"], rows["reuse"], rows["two steps"]
    assert first["calls"] == {"actor": 0, "ref": 1} and reuse["calls"] == {"actor": 0, "ref": 1}, rows
    assert recompute["calls"] == {"actor": 1, "ref": 1} and two["calls"] == {"actor": 1, "ref": 1}, rows
    # the actor trained on rollout 0 has left the reference, and the rollout's log-probs (-1) are not the trainer's
    assert abs(recompute["rollout/kl"]) > 1e-3 and recompute["train/train_rollout_logprob_abs_diff"] > 1, rows
    assert recompute["train/grad_norm"] > 0 and reuse["train/ppo_kl"] == 0.0
    for key in SAME:
        assert reuse[key] == pytest.approx(recompute[key], rel=1e-6, abs=1e-6), key
    assert abs(recompute["train/ppo_kl"]) < 1e-6  # the recomputed old log-probs are the loss's own
    assert not any(r["leaked"] for r in rows.values()), rows
    mixed, mixed_reuse = rows["mixed recompute"], rows["mixed reuse"]
    assert mixed_reuse["calls"]["actor"] == 0 and mixed["calls"]["actor"] == 1, rows
    for key in SAME:
        assert mixed_reuse[key] == pytest.approx(mixed[key], rel=1e-6, abs=1e-6), key


def test_kl_coef_keeps_the_pass(runs):
    row = runs["kl-coef"].result()[0]
    assert row["calls"] == {"actor": 1, "ref": 1} and row["rollout/kl"] is not None, row
