"""PPO / GSPO / CISPO surrogates, TIS weights, value, entropy and SFT losses."""

import math

import pytest
import torch

from slime.algorithms.policy_loss import (
    cispo_loss,
    entropy_from_logits,
    gspo_policy_loss,
    opsm_keep,
    policy_loss,
    sft_loss,
    tis_weights,
    value_loss,
)
from slime.algorithms.reduce import token_mean

NAN, INF = math.nan, math.inf
FULL = torch.ones(2, 3, dtype=torch.bool)
OLD = torch.full((2, 3), -1.0)

# eps_clip 0.2, eps_clip_high 0.3: ratios are clipped to [0.8, 1.3].
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [0.5, 3.0, 2.0]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
# token        -ratio*A   -clip(ratio)*A   max   clip binds
# r=1.0 A=1     -1.0        -1.0           -1.0      0
# r=1.5 A=1     -1.5        -1.3           -1.3      1
# r=0.5 A=1     -0.5        -0.8           -0.5      0   (out of range, but the clip does not bind)
# r=0.5 A=-2     1.0         1.6            1.6      1
# r=3.0 A=-2     6.0         2.6            6.0      0   (dual clip with c=2.5: min(6, 5) = 5)
# r=2.0 A=0      0.0         0.0            0.0      0
PPO_LOSS = torch.tensor([[-1.0, -1.3, -0.5], [1.6, 6.0, 0.0]])
PPO_CLIPFRAC = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def _log_probs(ratios, old=OLD):
    return old + ratios.log()


def test_ppo_hand_values():
    out = policy_loss(_log_probs(RATIOS), OLD, ADV, FULL, eps_clip=0.2, eps_clip_high=0.3)
    torch.testing.assert_close(out.loss, PPO_LOSS)
    torch.testing.assert_close(out.clipfrac, PPO_CLIPFRAC)
    torch.testing.assert_close(out.ppo_kl, -RATIOS.log())  # old - new
    # clip fraction over the 6 tokens: 2 / 6
    torch.testing.assert_close(token_mean(out.clipfrac, FULL), torch.tensor(2 / 6))


def test_ppo_symmetric_clip_by_default():
    # eps_clip_high None -> 0.2: r = 1.5, A = 1 gives -1.2 instead of -1.3
    out = policy_loss(_log_probs(RATIOS), OLD, ADV, FULL, eps_clip=0.2)
    assert out.loss[0, 1].item() == pytest.approx(-1.2)


def test_dual_clip_hand_values():
    out = policy_loss(_log_probs(RATIOS), OLD, ADV, FULL, eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=2.5)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.0, -1.3, -0.5], [1.6, 5.0, 0.0]]))
    torch.testing.assert_close(out.clipfrac, PPO_CLIPFRAC)  # the dual clip is not counted


def test_dual_clip_caps_negative_advantage_loss():
    gen = torch.Generator().manual_seed(0)
    ratios = torch.rand(4, 16, generator=gen) * 6
    adv = -torch.rand(4, 16, generator=gen) - 0.1
    mask = torch.ones(4, 16, dtype=torch.bool)
    out = policy_loss(
        _log_probs(ratios, torch.zeros(4, 16)), torch.zeros(4, 16), adv, mask, eps_clip=0.2, eps_clip_c=3.0
    )
    cap = 3.0 * adv.abs()
    assert (out.loss <= cap + 1e-6).all()
    above = ratios > 3.0
    assert above.any()
    torch.testing.assert_close(out.loss[above], cap[above])


def test_dual_clip_constant_must_exceed_one():
    with pytest.raises(ValueError, match="> 1"):
        policy_loss(OLD, OLD, ADV, FULL, eps_clip=0.2, eps_clip_c=1.0)


def test_clipfrac_counts_exactly_the_clipped_tokens():
    gen = torch.Generator().manual_seed(1)
    ratios = torch.rand(8, 32, generator=gen) * 2
    adv = torch.randn(8, 32, generator=gen)
    mask = torch.ones(8, 32, dtype=torch.bool)
    out = policy_loss(
        _log_probs(ratios, torch.zeros(8, 32)),
        torch.zeros(8, 32),
        adv,
        mask,
        eps_clip=0.2,
        eps_clip_high=0.28,
    )
    clipped = ((ratios > 1.28) & (adv > 0)) | ((ratios < 0.8) & (adv < 0))
    assert torch.equal(out.clipfrac.bool(), clipped)


def test_gradient_at_ratio_one_is_minus_advantage():
    adv = torch.tensor([[0.7, -1.3, 2.0], [-0.4, 0.0, 5.0]])
    log_probs = OLD.clone().requires_grad_()
    policy_loss(log_probs, OLD, adv, FULL, eps_clip=0.2, eps_clip_c=3.0).loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, -adv)


def test_gspo_hand_values():
    # one sample, log-ratios [ln 2, 0]: mean ln 2 / 2, sequence ratio sqrt(2) = 1.4142 > 1.3,
    # A = 1 -> both tokens lose max(-1.4142, -1.3) = -1.3, both clipped, ppo_kl = -ln 2 / 2
    old = torch.tensor([[-1.0, -2.0]])
    log_probs = old + torch.tensor([[math.log(2.0), 0.0]])
    out = gspo_policy_loss(
        log_probs, old, torch.ones(1, 2), torch.ones(1, 2), eps_clip=0.2, eps_clip_high=0.3
    )
    torch.testing.assert_close(out.loss, torch.tensor([[-1.3, -1.3]]))
    torch.testing.assert_close(out.clipfrac, torch.tensor([[1.0, 1.0]]))
    torch.testing.assert_close(out.ppo_kl, torch.full((1, 2), -math.log(2.0) / 2))


def test_gspo_equals_ppo_when_a_sequence_shares_one_ratio():
    gen = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    old = torch.randn(3, 4, generator=gen) - 2
    log_probs = old + torch.tensor([[0.5], [-0.4], [0.1]])  # one log-ratio per row
    adv = torch.randn(3, 4, generator=gen)
    kwargs = {"eps_clip": 0.2, "eps_clip_high": 0.28, "eps_clip_c": 3.0}
    for a, b in zip(
        policy_loss(log_probs, old, adv, mask, **kwargs),
        gspo_policy_loss(log_probs, old, adv, mask, **kwargs),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


def test_gspo_gradient_at_ratio_one_is_spread_over_the_sequence():
    # ratio = exp(mean_t (logp_t - old_t)): d/dlogp_t (-ratio * A_t summed over t) = -sum_t(A_t) / n at ratio 1
    # row 0: A = [1, 2, 3], n = 3 -> each token -6/3 = -2;  row 1: A = [1, -3, x], n = 2 -> each -(-2)/2 = 1
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 2.0, 3.0], [1.0, -3.0, 7.0]])
    log_probs = OLD.clone().requires_grad_()
    gspo_policy_loss(log_probs, OLD, adv, mask, eps_clip=0.2).loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-2.0, -2.0, -2.0], [1.0, 1.0, 0.0]]))


def test_cispo_hand_values_and_gradient():
    # eps_clip 0.2, eps_clip_high 0.28 -> ratios [1.0, 1.5, 0.5] become [1.0, 1.28, 0.8]
    # loss = -sg(clipped) * A * logp:  -1 * 1 * -0.7 = 0.7;  -1.28 * -0.5 * -1.2 = -0.768;  -0.8 * 2 * -0.4 = 0.64
    # gradient w.r.t. logp = -clipped * A = [-1, 0.64, -1.6]
    logp = torch.tensor([[-0.7, -1.2, -0.4]], requires_grad=True)
    old = logp.detach() - torch.tensor([[1.0, 1.5, 0.5]]).log()
    adv = torch.tensor([[1.0, -0.5, 2.0]])
    out = cispo_loss(logp, old, adv, torch.ones(1, 3), eps_clip=0.2, eps_clip_high=0.28)
    torch.testing.assert_close(out.loss, torch.tensor([[0.7, -0.768, 0.64]]))
    torch.testing.assert_close(out.clipfrac, torch.tensor([[0.0, 1.0, 1.0]]))
    out.loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.64, -1.6]]))


@pytest.mark.parametrize("loss_fn", [policy_loss, gspo_policy_loss, cispo_loss])
def test_masked_garbage_never_leaks(loss_fn):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    garbage = torch.tensor([[0.0, 0.0, NAN], [0.0, INF, -INF]])
    old_garbage = torch.tensor([[0.0, 0.0, INF], [0.0, NAN, -INF]])
    log_probs = _log_probs(RATIOS)
    clean = loss_fn(
        torch.where(mask, log_probs, 0.0),
        torch.where(mask, OLD, 0.0),
        torch.where(mask, ADV, 0.0),
        mask,
        eps_clip=0.2,
    )
    dirty_lp = (log_probs + garbage).requires_grad_()
    dirty = loss_fn(dirty_lp, OLD + old_garbage, ADV - garbage, mask, eps_clip=0.2)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)
        assert (b[~mask] == 0).all()
    dirty.loss.sum().backward()
    assert torch.isfinite(dirty_lp.grad).all() and (dirty_lp.grad[~mask] == 0).all()


def test_tis_weights_clamp():
    # old - rollout = [0, ln 3, -ln 4, ln 1.5] -> exp [1, 3, 0.25, 1.5] -> clamp to [0.5, 2]: [1, 2, 0.5, 1.5]
    rollout = torch.tensor([-1.0, -2.0, -0.5, -1.0])
    old = (rollout + torch.tensor([0.0, math.log(3), -math.log(4), math.log(1.5)])).requires_grad_()
    w = tis_weights(old, rollout, 0.5, 2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 2.0, 0.5, 1.5]))
    assert not w.requires_grad


def test_tis_weights_are_neutral_where_masked():
    w = tis_weights(
        torch.tensor([[0.0, NAN]]), torch.tensor([[0.0, INF]]), 0.0, 2.0, mask=torch.tensor([[1, 0]])
    )
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0]]))


def test_value_loss_hand_values():
    # value_clip 0.2:
    # v=1.0 old=1.0 R=2: clipped 1.0 -> max(1, 1) = 1, not clipped
    # v=1.5 old=1.0 R=2: clipped 1.2 -> max(0.64, 0.25) = 0.64, clipped
    # v=0.5 old=1.0 R=0: clipped 0.8 -> max(0.64, 0.25) = 0.64, clipped
    # v=1.5 old=1.0 R=1: clipped 1.2 -> max(0.04, 0.25) = 0.25, clipped; then two masked garbage tokens
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    values = torch.tensor([[1.0, 1.5, 0.5], [1.5, NAN, INF]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0], [1.0, INF, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 0.0], [1.0, 0.0, NAN]])
    out = value_loss(values, old, returns, mask, 0.2)
    torch.testing.assert_close(out.loss, torch.tensor([[1.0, 0.64, 0.64], [0.25, 0.0, 0.0]]))
    torch.testing.assert_close(out.clipfrac, torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    out.loss.sum().backward()
    # d/dv: t0 both branches are 2 (v - R) = -2 (clamp inactive); t3 takes (v - R)^2 -> 2 * 0.5 = 1;
    # t1, t2 take the clipped branch with the clamp saturated -> 0; masked tokens -> 0
    torch.testing.assert_close(values.grad, torch.tensor([[-2.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def test_entropy_hand_values():
    # uniform over 4 -> ln 4; two live tokens of 4 -> ln 2;
    # p = [3/4, 1/4] -> -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.2157616 + 0.3465736 = 0.5623351
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -INF, -INF, 0.0], [math.log(3.0), 0.0, -INF, -INF]])
    logits.requires_grad_()
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h, torch.tensor([math.log(4.0), math.log(2.0), 0.5623351]))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_matches_categorical():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(3)) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)


def test_sft_loss():
    out = sft_loss(torch.tensor([[-0.5, -1.0, NAN]]), torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(out, torch.tensor([[0.5, 1.0, 0.0]]))


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(OLD, OLD, torch.ones(2), FULL, eps_clip=0.2)


def test_opsm_masks_drifted_sequences_with_negative_advantage():
    # seq KL = mean over trained tokens of old - new: row 0: (0.3 + 0.1) / 2 = 0.2 (3rd token untrained);
    # row 1: 0.0; row 2: 0.2 but a positive advantage
    old = torch.tensor([[-1.0, -1.0, -9.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    new = torch.tensor([[-1.3, -1.1, 0.0], [-1.0, -1.0, -1.0], [-1.2, -1.2, -1.2]])
    adv = torch.tensor([[-1.0] * 3, [-1.0] * 3, [1.0] * 3])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    keep = opsm_keep(new, old, adv, mask, delta=0.1)
    assert keep.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    assert opsm_keep(new, old, adv, mask, delta=0.25).tolist() == [[1.0] * 3] * 3  # 0.2 is not above 0.25
