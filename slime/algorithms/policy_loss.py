"""Per-token losses of the actor and critic: PPO, GSPO and CISPO surrogates, TIS, value, entropy, SFT.

Inputs are ``[B, T]`` with a ``mask`` of trained tokens (see ``slime.algorithms``); every
per-token output is 0 at masked positions and never depends on what those positions held.
Reduce the outputs to scalars with ``slime.algorithms.reduce``. ``log_probs`` is the current
policy's (with gradient); ``old_log_probs`` the behaviour policy's (recomputed by the trainer, or
the engine's with ``use_rollout_logprobs``), treated as constants like the advantages.

PPO (arXiv:1707.06347) with asymmetric clip (DAPO, arXiv:2503.14476) and dual clip
(arXiv:1912.09729); slime ``compute_policy_loss`` in THUDM/slime ``slime/utils/ppo_utils.py``:

    ratio_t = exp(logp_t - old_t)                 ppo_kl_t = old_t - logp_t
    L_t     = max(-ratio_t * A_t, -clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high) * A_t)
    dual    : L_t = min(L_t, -eps_clip_c * A_t) where A_t < 0      (eps_clip_c > 1)
    clipfrac_t = 1 where the clipped term is strictly the larger one (the clip binds), else 0;
                 the dual clip is not counted, as in slime.

GSPO (arXiv:2507.18071; slime ``compute_gspo_kl``): the same L_t with every token's ratio
replaced by the sample's exp(mean over trained tokens of (logp - old)).

CISPO (MiniMax-M1, arXiv:2506.13585 eq. 4-5; slime ``compute_cispo_loss``):

    L_t = -sg(clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high)) * A_t * logp_t
    clipfrac_t = 1 where the clip changed the ratio.

TIS (https://fengyao.notion.site/off-policy-rl; slime ``vanilla_tis_function`` in
``slime/backends/megatron_utils/loss.py``): multiply L_t by
w_t = sg(clamp(exp(old_t - rollout_t), tis_clip_low, tis_clip)).

Value loss (slime ``value_loss_function``): clipped squared error without the 1/2 factor,

    V_clip_t = old_V_t + clamp(V_t - old_V_t, -value_clip, value_clip)
    L_t      = max((V_clip_t - R_t)^2, (V_t - R_t)^2),   clipfrac_t = [|V_t - old_V_t| > value_clip]

Entropy H = logsumexp(z) - sum_v softmax(z)_v z_v of the (temperature-scaled) logits z.
SFT: L_t = -logp_t.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # [B, T] per-token surrogate loss
    clipfrac: torch.Tensor  # [B, T] 1.0 where clipping bound the token; reduce it to get the fraction
    ppo_kl: torch.Tensor  # [B, T] old - new log-prob (GSPO: its sample's mean), a KL estimate


class ValueLossOutput(NamedTuple):
    loss: torch.Tensor  # [B, T] per-token clipped squared error
    clipfrac: torch.Tensor  # [B, T] 1.0 where the value moved more than value_clip


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 with masked positions 0; gradient flows to the trained positions only."""
    return torch.where(mask, x.float(), 0.0)


def _inputs(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check shapes; return (log_probs, old_log_probs, advantages, mask) cleaned, the last two detached."""
    for name, x in (("old_log_probs", old_log_probs), ("advantages", advantages), ("mask", mask)):
        if x.shape != log_probs.shape:
            raise ValueError(f"{name} {tuple(x.shape)} does not match log_probs {tuple(log_probs.shape)}")
    mask = mask.bool()
    return (
        _masked(log_probs, mask),
        _masked(old_log_probs.detach(), mask),
        _masked(advantages.detach(), mask),
        mask,
    )


def _clip_ratio(ratio: torch.Tensor, eps_clip: float, eps_clip_high: float | None) -> torch.Tensor:
    """clip(ratio, 1 - eps_clip, 1 + eps_clip_high); ``eps_clip_high=None`` means ``eps_clip`` (symmetric)."""
    return ratio.clamp(1 - eps_clip, 1 + (eps_clip if eps_clip_high is None else eps_clip_high))


def _clipped_surrogate(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None,
    eps_clip_c: float | None,
) -> PolicyLossOutput:
    """PPO's clipped (and optionally dual-clipped) loss from ppo_kl = old - new, ``[B, T]``."""
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -_clip_ratio(ratio, eps_clip, eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"dual-clip eps_clip_c must be > 1, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return PolicyLossOutput(_masked(loss, mask), _masked(clipfrac, mask), _masked(ppo_kl, mask))


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> PolicyLossOutput:
    """Token-level PPO clipped surrogate (module docstring); all tensors ``[B, T]``.

    ``eps_clip_high=None`` means ``eps_clip`` (symmetric clip); ``eps_clip_c=None`` turns the
    dual clip off. At ratio 1 the gradient of L_t with respect to logp_t is -A_t.
    """
    log_probs, old_log_probs, advantages, mask = _inputs(log_probs, old_log_probs, advantages, mask)
    ppo_kl = old_log_probs - log_probs
    return _clipped_surrogate(ppo_kl, advantages, mask, eps_clip, eps_clip_high, eps_clip_c)


def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> PolicyLossOutput:
    """GSPO: ``policy_loss`` with one sequence-level ratio per sample; all tensors ``[B, T]``.

    The sample's ppo_kl is sum_t m_t (old_t - logp_t) / max(sum_t m_t, 1), broadcast to its
    tokens; the gradient reaches every trained token through that mean.
    """
    log_probs, old_log_probs, advantages, mask = _inputs(log_probs, old_log_probs, advantages, mask)
    n_tokens = mask.sum(dim=-1, keepdim=True).clamp_min(1)  # [B, 1]
    seq_kl = (old_log_probs - log_probs).sum(dim=-1, keepdim=True) / n_tokens  # [B, 1]
    ppo_kl = seq_kl.expand_as(log_probs)
    return _clipped_surrogate(ppo_kl, advantages, mask, eps_clip, eps_clip_high, eps_clip_c)


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> PolicyLossOutput:
    """CISPO: -sg(clip(ratio)) * A * logp; all tensors ``[B, T]``.

    The gradient flows through ``log_probs`` only, so clipped tokens still contribute (scaled by
    the clipped ratio). Canonical CISPO has no lower bound: pass ``eps_clip >= 1``.
    """
    log_probs, old_log_probs, advantages, mask = _inputs(log_probs, old_log_probs, advantages, mask)
    ppo_kl = old_log_probs - log_probs
    ratio = torch.exp(-ppo_kl)
    truncated = _clip_ratio(ratio, eps_clip, eps_clip_high)
    loss = -truncated.detach() * advantages * log_probs
    clipfrac = (truncated != ratio).float()
    return PolicyLossOutput(_masked(loss, mask), _masked(clipfrac, mask), _masked(ppo_kl, mask))


def tis_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    clip_low: float,
    clip_high: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Truncated importance-sampling weights sg(clamp(exp(old - rollout), clip_low, clip_high)).

    Args:
        old_log_probs: ``[B, T]`` trainer log-probs of the behaviour policy.
        rollout_log_probs: ``[B, T]`` the engine's log-probs of the same tokens.
        clip_low, clip_high: ``tis_clip_low`` and ``tis_clip``.
        mask: optional ``[B, T]`` trained tokens; masked weights are 1 (neutral).
    Returns:
        ``[B, T]`` float32 weights without gradient, to multiply the per-token policy loss.
    """
    log_ratio = old_log_probs.detach().float() - rollout_log_probs.detach().float()
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, 0.0)
    return torch.exp(log_ratio).clamp(clip_low, clip_high)


def opsm_keep(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """Off-policy sequence masking (OPSM; slime's ``compute_opsm_mask``): drop the policy loss of a sequence
    whose advantage is negative and whose policy has drifted, i.e. mean_t (old_t - logp_t) > delta.

    Args:
        log_probs, old_log_probs, advantages: ``[B, T]``.
        mask: ``[B, T]`` trained tokens; the sequence KL averages over them (at least 1 token).
        delta: ``opsm_delta``.
    Returns:
        ``[B, T]`` float32, 0 on the tokens of a masked sequence with a negative advantage, else 1.
    """
    m = mask.float()
    seq_kl = ((old_log_probs.detach().float() - log_probs.detach().float()) * m).sum(-1) / m.sum(-1).clamp_min(1)
    drop = (advantages.float() < 0) & (seq_kl > delta).unsqueeze(-1)
    return 1.0 - drop.float()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float,
) -> ValueLossOutput:
    """Clipped value loss (module docstring); all tensors ``[B, T]``.

    Args:
        values: critic values now (with gradient).
        old_values: critic values when the advantages were computed.
        returns: targets R_t (``advantages.compute_advantages(...).returns``).
        mask: trained tokens.
        value_clip: largest move of V counted without clipping.
    """
    for name, x in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if x.shape != values.shape:
            raise ValueError(f"{name} {tuple(x.shape)} does not match values {tuple(values.shape)}")
    mask = mask.bool()
    values = _masked(values, mask)
    old_values = _masked(old_values.detach(), mask)
    returns = _masked(returns.detach(), mask)
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped - returns).square(), (values - returns).square())
    clipfrac = ((values - old_values).abs() > value_clip).float()
    return ValueLossOutput(_masked(loss, mask), _masked(clipfrac, mask))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last (vocabulary) dimension.

    Args:
        logits: ``[..., V]``, already divided by the sampling temperature as slime does;
            ``-inf`` entries (tokens ruled out) contribute 0.
    Returns:
        ``[...]`` float32 entropies in nats.
    """
    log_p = torch.log_softmax(logits.float(), dim=-1)
    p = log_p.exp()
    # p * log p is 0 * -inf = NaN for ruled-out tokens; their term is 0 by continuity.
    return -(p * torch.where(p > 0, log_p, 0.0)).sum(dim=-1)


def sft_loss(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood -logp_t, ``[B, T]``, 0 at masked positions."""
    if mask.shape != log_probs.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match log_probs {tuple(log_probs.shape)}")
    return -_masked(log_probs, mask.bool())
