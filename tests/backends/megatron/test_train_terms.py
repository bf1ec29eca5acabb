"""The policy-loss terms of one micro-batch (`_policy_terms`) for slime's --use-unbiased-kl and --use-opsm,
against values written out by hand (no model: log-probs are given)."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from slime.algorithms.kl import compute_approx_kl
from slime.backends.megatron.step_data import MicroBatch
from slime.backends.megatron.train import StepSettings, _policy_terms, _Step

MASK = torch.ones(2, 2, dtype=torch.bool)
LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
OLD = torch.tensor([[-1.2, -2.1], [-0.5, -0.5]])
REF = torch.tensor([[-1.5, -1.5], [-0.4, -0.6]])
ADV = torch.tensor([[-1.0, -1.0], [1.0, 1.0]])


def _terms(old=OLD, **settings):
    step = _Step(StepSettings(loss_type="policy_loss", **settings), vocab_size=8, num_samples=2, num_tokens=4,
                 scale=1.0)
    micro = MicroBatch(indices=[0, 1], batch=None, loss_mask=MASK, advantages=ADV, rollout_log_probs=None,
                       old_log_probs=old, ref_log_probs=REF, returns=None, old_values=None)
    return _policy_terms(step, micro, LOGP, torch.zeros(2, 2), MASK)


def _sample_mean(x: torch.Tensor) -> float:
    return float(x.mean(-1).sum() / 2)


def test_unbiased_kl_weights_the_kl_by_pi_over_pi_old():
    plain = _terms(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k3")[1]["kl_loss"]
    unbiased = _terms(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k3", use_unbiased_kl=True)[1]["kl_loss"]
    k3 = compute_approx_kl(LOGP, REF, "k3")
    assert math.isclose(float(plain), _sample_mean(k3), rel_tol=1e-6)
    assert math.isclose(float(unbiased), _sample_mean(k3 * torch.exp(LOGP - OLD)), rel_tol=1e-6)
    assert float(unbiased) != float(plain)


def test_opsm_drops_the_drifted_negative_sample():
    # sample 0: advantage -1, seq KL = (-1.2 + 1.0 - 2.1 + 2.0) / 2 = -0.15 -> kept at delta 1e-4 ...
    total, parts = _terms(use_opsm=True, opsm_delta=1e-4)
    assert float(parts["opsm_clipfrac"]) == 0.0
    # ... and with the old policy above the new one (seq KL 0.15 > 1e-4), dropped: only sample 1 is left
    drifted = torch.tensor([[-0.8, -1.9], [-0.5, -0.5]])
    baseline = _terms(drifted)[1]["pg_loss"]
    total, parts = _terms(drifted, use_opsm=True, opsm_delta=1e-4)
    assert float(parts["opsm_clipfrac"]) == 0.5  # one of two samples
    ratio1 = 1.0  # sample 1: logp == old
    assert math.isclose(float(parts["pg_loss"]), -ratio1 * 1.0 / 2, rel_tol=1e-6)  # sample 1's -A*ratio, / N
    assert float(baseline) != float(parts["pg_loss"])


def test_reset_optimizer_states_zeroes_adam_like_a_new_one():
    from types import SimpleNamespace

    from slime.backends.megatron.optimizer import reset_optimizer_states

    param = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.ones(3)
    adam.step()
    state = adam.state[param]
    assert float(state["step"]) == 1 and float(state["exp_avg"].abs().sum()) > 0
    reset_optimizer_states(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)]))
    assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert torch.allclose(param.detach(), torch.full((3,), 0.9))  # parameters untouched
    fresh = torch.optim.Adam([torch.nn.Parameter(param.detach().clone())], lr=0.1)
    for opt, p in ((adam, param), (fresh, fresh.param_groups[0]["params"][0])):
        p.grad = torch.full((3,), 0.5)
        opt.step()
    assert torch.equal(param.detach(), fresh.param_groups[0]["params"][0].detach())  # the same next step


def test_mismatch_metrics_without_reweighting():
    rollout = torch.tensor([[-1.0, -2.3], [-0.5, -0.2]])  # vs OLD: log-ratios 0.2-... per token below
    step = _Step(StepSettings(loss_type="policy_loss", get_mismatch_metrics=True, tis_clip=1.1, tis_clip_low=0.9),
                 vocab_size=8, num_samples=2, num_tokens=4, scale=1.0)
    micro = MicroBatch(indices=[0, 1], batch=None, loss_mask=MASK, advantages=ADV, rollout_log_probs=rollout,
                       old_log_probs=OLD, ref_log_probs=None, returns=None, old_values=None)
    _, parts = _policy_terms(step, micro, LOGP, torch.zeros(2, 2), MASK)
    raw = torch.exp(OLD - rollout)
    assert math.isclose(float(parts["mismatch/tis"]), _sample_mean(raw), rel_tol=1e-6)
    assert math.isclose(float(parts["mismatch/tis_abs"]), _sample_mean((raw - 1).abs()), rel_tol=1e-6)
    clipped = ((raw < 0.9) | (raw > 1.1)).float()
    assert math.isclose(float(parts["mismatch/tis_clipfrac"]), _sample_mean(clipped), rel_tol=1e-6)
    assert math.isclose(float(parts["mismatch/ois"]), _sample_mean(torch.exp(LOGP - OLD)), rel_tol=1e-6)
    plain = _terms()[1]["pg_loss"]
    assert float(parts["pg_loss"]) == float(plain)  # metrics only: the loss is not reweighted


ICEPOP = '''
import torch


def icepop(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """slime's TIS-function signature (its icepop_function): zero weight outside [tis_clip_low, tis_clip]."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weight = torch.where((ratio >= args.tis_clip_low) & (ratio <= args.tis_clip), ratio, torch.zeros_like(ratio))
    assert kwargs["response_lengths"] == [2, 2] and kwargs["total_lengths"] == [5, 4]
    return pg_loss * weight, loss_masks, {"ice_clipfrac": (weight != ratio).float()}
'''


def test_custom_tis_function_on_slimes_layout(make_module):
    from slime.algorithms.policy_loss import policy_loss
    from slime.backends.megatron.logprobs import PaddedBatch
    from slime.backends.megatron.train import load_tis_function
    from slime.config import load_config

    mod = make_module(ICEPOP)
    args = load_config(None, ["--use-tis", "--tis-clip", "1.1", "--tis-clip-low", "0.9"]).as_namespace()
    settings = StepSettings(loss_type="policy_loss", use_tis=True,
                            custom_tis=partial(load_tis_function(f"{mod}.icepop"), args=args))
    rollout = torch.tensor([[-1.25, -2.1], [-0.5, -0.2]])  # ratios exp(OLD - rollout): 1.05, 1.0, 1.0, 0.74
    batch = PaddedBatch(tokens=torch.zeros(2, 5, dtype=torch.long), prompt_lengths=torch.tensor([3, 2]),
                        response_lengths=torch.tensor([2, 2]))
    micro = MicroBatch(indices=[0, 1], batch=batch, loss_mask=MASK, advantages=ADV, rollout_log_probs=rollout,
                       old_log_probs=OLD, ref_log_probs=None, returns=None, old_values=None)
    step = _Step(settings, vocab_size=8, num_samples=2, num_tokens=4, scale=1.0)
    _, parts = _policy_terms(step, micro, LOGP, torch.zeros(2, 2), MASK)
    ratio = torch.exp(OLD - rollout)
    weight = torch.where((ratio >= 0.9) & (ratio <= 1.1), ratio, torch.zeros_like(ratio))
    expected = policy_loss(LOGP, OLD, ADV, MASK, eps_clip=0.2, eps_clip_high=None).loss * weight
    assert math.isclose(float(parts["pg_loss"]), _sample_mean(expected), rel_tol=1e-6)
    assert float(parts["ice_clipfrac"]) == 0.25  # one of two tokens of sample 1: (0 + 0.5) / 2


def test_custom_tis_function_with_the_wrong_signature_is_refused(make_module):
    from slime.backends.megatron.train import load_tis_function
    from slime.plugins import PluginError

    mod = make_module("def tis(args, pg_loss):\n    return pg_loss, None, {}\n")
    with pytest.raises(PluginError, match="--custom-tis-function-path"):
        load_tis_function(f"{mod}.tis")


REDUCERS = '''
import torch


def sum_of_sample_mean(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """slime's default reduction written as a custom reducer: the same pg_loss as the built-in one."""
    def reduce(x):
        parts = torch.split(x, response_lengths)
        return sum((p * m).sum() / m.sum().clamp_min(1) for p, m in zip(parts, loss_masks))
    return reduce


def sum_of_sample_max(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    return lambda x: sum(p.max() for p in torch.split(x, response_lengths))
'''


def test_custom_pg_loss_reducer(make_module):
    from slime.backends.megatron.logprobs import PaddedBatch
    from slime.config import load_config

    mod = make_module(REDUCERS)
    batch = PaddedBatch(tokens=torch.zeros(2, 5, dtype=torch.long), prompt_lengths=torch.tensor([3, 2]),
                        response_lengths=torch.tensor([2, 2]))
    micro = MicroBatch(indices=[0, 1], batch=batch, loss_mask=MASK, advantages=ADV, rollout_log_probs=None,
                       old_log_probs=OLD, ref_log_probs=None, returns=None, old_values=None)

    def pg_loss(reducer: str | None) -> float:
        flags = ["--custom-pg-loss-reducer-function-path", f"{mod}.{reducer}"] if reducer else []
        settings = StepSettings.from_config(load_config(None, flags))
        step = _Step(settings, vocab_size=8, num_samples=2, num_tokens=4, scale=1.0)
        return float(_policy_terms(step, micro, LOGP, torch.zeros(2, 2), MASK)[1]["pg_loss"])

    assert math.isclose(pg_loss("sum_of_sample_mean"), pg_loss(None), rel_tol=1e-6)
    from slime.algorithms.policy_loss import policy_loss

    per_token = policy_loss(LOGP, OLD, ADV, MASK, eps_clip=0.2, eps_clip_high=None).loss
    assert math.isclose(pg_loss("sum_of_sample_max"), float(per_token.max(-1).values.sum()) / 2, rel_tol=1e-6)
