"""compute_approx_kl: hand values of k1, k2, k3, low_var_kl and their properties."""

import math

import pytest
import torch

from slime.algorithms.kl import KL_TYPES, compute_approx_kl

LN2 = math.log(2.0)
# log_ratio x = log_probs - ref_log_probs = [0, ln 2, -ln 2]; ref is -1 so the sign of the
# difference (not of the inputs) is what matters.
REF = torch.tensor([-1.0, -1.0, -1.0])
LOG_PROBS = REF + torch.tensor([0.0, LN2, -LN2])


def test_k1_is_the_log_ratio():
    torch.testing.assert_close(compute_approx_kl(LOG_PROBS, REF, "k1"), torch.tensor([0.0, LN2, -LN2]))


def test_k2_is_half_the_squared_log_ratio():
    # x^2 / 2: 0, (ln 2)^2 / 2 = 0.2402265, same for -ln 2
    expected = torch.tensor([0.0, 0.2402265, 0.2402265])
    torch.testing.assert_close(compute_approx_kl(LOG_PROBS, REF, "k2"), expected)


def test_k3_hand_values():
    # exp(-x) - 1 + x:  x = 0 -> 0;  x = ln 2 -> 1/2 - 1 + ln 2 = 0.1931472;  x = -ln 2 -> 2 - 1 - ln 2 = 0.3068528
    expected = torch.tensor([0.0, LN2 - 0.5, 1.0 - LN2])
    torch.testing.assert_close(compute_approx_kl(LOG_PROBS, REF, "k3"), expected)
    # inside the clamp low_var_kl is k3
    torch.testing.assert_close(compute_approx_kl(LOG_PROBS, REF, "low_var_kl"), expected)


def test_low_var_kl_clamps_at_10_and_k3_does_not():
    # x = -15: k3 = e^15 - 1 - 15 = 3269002.37;  x = 15: k3 = e^-15 - 1 + 15 = 14.0000003
    x = torch.tensor([-15.0, 15.0])
    zeros = torch.zeros(2)
    torch.testing.assert_close(compute_approx_kl(x, zeros, "low_var_kl"), torch.tensor([10.0, 10.0]))
    k3 = compute_approx_kl(x, zeros, "k3")
    torch.testing.assert_close(k3, torch.tensor([math.exp(15) - 16.0, 14.0]), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_zero_when_policies_agree(kl_type):
    lp = torch.randn(4, 7) - 2.0
    assert torch.equal(compute_approx_kl(lp, lp.clone(), kl_type), torch.zeros(4, 7))


def test_sign_and_range_properties():
    gen = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(64, generator=gen) * 5, torch.randn(64, generator=gen) * 5
    assert (compute_approx_kl(lp, ref, "k2") >= 0).all()
    assert (compute_approx_kl(lp, ref, "k3") >= 0).all()
    low_var = compute_approx_kl(lp, ref, "low_var_kl")
    assert ((low_var >= 0) & (low_var <= 10)).all()
    assert (compute_approx_kl(lp, ref, "k3") > 10).any()  # the clamp was exercised


def test_computes_in_float32():
    lp = torch.tensor([0.5], dtype=torch.bfloat16)
    assert compute_approx_kl(lp, torch.zeros(1, dtype=torch.bfloat16), "k3").dtype == torch.float32


def test_unknown_type_names_the_valid_ones():
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        compute_approx_kl(LOG_PROBS, REF, "k4")
