"""slime's --ci-test invariants (slime.ray.ci_checks) on hand-made metrics: each check passes at its bound's good
side and fails, naming itself, on the other."""

from __future__ import annotations

import pytest

from slime.config import load_config
from slime.errors import ConfigError, InvariantError
from slime.ray.ci_checks import KL_BOUND, check_ci, check_grad_norms, ci_failures, save_grad_norms


def _settings(*flags: str):
    return load_config(None, ["--ci-test", *flags]).as_namespace()


GOOD_STEP = {"ppo_kl": 0.0, "kl_loss": 0.0, "pg_clipfrac": 0.0}
GOOD = {"train/train_rollout_logprob_abs_diff": 0.02, "rollout/kl": 0.0}


def test_a_healthy_first_rollout_passes():
    assert ci_failures(_settings(), 0, GOOD_STEP, GOOD) == []
    check_ci(_settings(), 0, GOOD_STEP, GOOD)


def test_logprob_gap_above_the_threshold_fails():
    metrics = {**GOOD, "train/train_rollout_logprob_abs_diff": 0.2}
    with pytest.raises(InvariantError, match=r"rollout 3: train/train_rollout_logprob_abs_diff = 0.2 > 0.1"):
        check_ci(_settings(), 3, GOOD_STEP, metrics)
    tight = _settings("--ci-train-rollout-logprob-abs-diff-threshold", "1e-6")
    assert ci_failures(tight, 3, GOOD_STEP, GOOD)  # 0.02 > 1e-6
    assert ci_failures(_settings("--ci-train-rollout-logprob-abs-diff-threshold", "0.2"), 3, GOOD_STEP, metrics) == []
    nan = {**GOOD, "train/train_rollout_logprob_abs_diff": float("nan")}
    assert ci_failures(_settings(), 3, GOOD_STEP, nan)  # NaN is not "below the bound"


def test_first_step_ppo_kl_must_be_zero_every_rollout():
    moved = {**GOOD_STEP, "ppo_kl": 10 * KL_BOUND}
    [problem] = ci_failures(_settings(), 5, moved, GOOD)
    assert "ppo_kl of the first step" in problem
    assert ci_failures(_settings(), 5, {**GOOD_STEP, "ppo_kl": KL_BOUND / 2}, GOOD) == []
    assert ci_failures(_settings("--ci-disable-kl-checker"), 5, moved, GOOD) == []
    # the old log-probs are the engine's: their gap is the log-prob check, not ppo_kl
    assert ci_failures(_settings("--use-rollout-logprobs"), 5, moved, GOOD) == []


def test_initial_kl_to_the_reference_is_checked_at_rollout_0_only():
    apart = {**GOOD_STEP, "kl_loss": 1e-3}
    metrics = {**GOOD, "rollout/kl": 1e-3}
    problems = ci_failures(_settings(), 0, apart, metrics)
    assert len(problems) == 2 and "kl_loss" in problems[0] and "rollout/kl" in problems[1]
    assert ci_failures(_settings(), 1, apart, metrics) == []  # later, the actor has moved on purpose
    assert ci_failures(_settings("--ci-disable-kl-checker"), 0, apart, metrics) == []


def test_grad_norms_saved_then_compared_within_slimes_tolerance(tmp_path):
    template = str(tmp_path / "gn" / "{role}-{rollout_id}-{step_id}.json")
    save_grad_norms(template, 2, [1.5, 0.25])
    assert (tmp_path / "gn" / "actor-2-1.json").is_file()
    check_grad_norms(template, 2, [1.5 * 1.005, 0.25])
    with pytest.raises(InvariantError, match=r"rollout 2 step 0: grad norm 1.7 != saved 1.5"):
        check_grad_norms(template, 2, [1.7, 0.25])
    with pytest.raises(InvariantError, match="no saved grad norm"):
        check_grad_norms(template, 3, [1.0])


def test_save_and_load_grad_norm_are_exclusive():
    with pytest.raises(ConfigError, match="ci_save_grad_norm or ci_load_grad_norm, not both"):
        load_config(None, ["--ci-save-grad-norm", "a", "--ci-load-grad-norm", "b"])
