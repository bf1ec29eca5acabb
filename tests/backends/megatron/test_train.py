"""One Megatron train step equals the same step written by hand on the HF model (fp32, CPU), for
every loss term the step supports; dynamic batching gives the same update as fixed micro-batches."""

import pytest
from script_rows import rows_by_case, run_script

CASES = ["sft per-sample, 3 micro-batches", "sft per-token, 1 micro-batch",
         "policy rollout log-probs, 6 micro-batches", "policy kl loss low_var_kl", "policy kl loss k2, per-token",
         "policy entropy", "policy tis", "gspo", "dual clip", "cispo per-token advantages",
         "policy dynamic batch size", "policy fixed micro-batches (dynamic's twin)"]


@pytest.fixture(scope="module")
def parity(tiny_kit):
    return rows_by_case(run_script("train_parity.py", tiny_kit.model_dir, timeout=900))


@pytest.mark.parametrize("case", CASES)
def test_train_step_matches_reference(parity, case):
    row = parity[case]
    # SGD, lr 0.5: weights move by 1e-3 .. 0.1; the two implementations agree to fp32 rounding
    assert row["weights_moved"] > 1e-4, row
    assert row["weight_gap"] < 1e-6, row
    assert abs(row["megatron_loss"] - row["hf_loss"]) < 1e-5, row


def test_compute_log_probs_matches_hf(parity):
    row = parity["compute_log_probs"]
    assert row["lengths"] == [6, 2, 8, 5, 3, 7]  # per sample, in the samples' order despite packing
    assert row["max_gap"] < 1e-5 and row["entropy_gap"] < 1e-4, row


def test_loss_terms_are_active(parity):
    """The cases exercise what they name: clipping binds on some tokens, TIS clips some weights."""
    for case in ("policy kl loss low_var_kl", "gspo", "dual clip", "cispo per-token advantages"):
        assert 0 < parity[case]["metrics"]["pg_clipfrac"] < 1, parity[case]
    tis = parity["policy tis"]["metrics"]
    assert 0 < tis["tis_clipfrac"] < 1 and tis["tis"] != 1.0, tis
    kl = parity["policy kl loss low_var_kl"]["metrics"]
    assert kl["kl_loss"] > 0 and abs(kl["loss"] - (kl["pg_loss"] + 0.5 * kl["kl_loss"])) < 1e-6, kl
    entropy = parity["policy entropy"]["metrics"]
    assert abs(entropy["loss"] - (entropy["pg_loss"] - 0.1 * entropy["entropy_loss"])) < 1e-6, entropy


def test_dynamic_batching_equals_fixed_micro_batches(parity):
    dynamic, fixed = parity["policy dynamic batch size"], parity["policy fixed micro-batches (dynamic's twin)"]
    # max_tokens_per_gpu 24 packs the 6 samples (lengths 10, 11, 11, 11, 5, 14) into 4 micro-batches
    assert dynamic["metrics"]["num_microbatches"] == 4 and fixed["metrics"]["num_microbatches"] == 3
    assert dynamic["metrics"]["max_microbatch_tokens"] <= 24 < fixed["metrics"]["max_microbatch_tokens"]
    assert fixed["gap_to_dynamic"] < 1e-6, fixed  # same update within fp32 rounding
    assert abs(dynamic["megatron_loss"] - fixed["megatron_loss"]) < 1e-6
