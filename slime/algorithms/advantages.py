"""Token-level advantages and returns for slime's advantage estimators.

Layout (see ``slime.algorithms``): ``rewards [B]`` are the per-sample scalar rewards, already
group-normalised where the estimator wants it (``rewards.normalize_group_rewards``);
``mask [B, T]`` marks trained response tokens; ``kl [B, T]`` is the per-token KL to the
reference policy (``kl.compute_approx_kl``), zeros when ``kl_coef == 0``; ``values [B, T]`` are
critic values. Outputs are ``[B, T]``, zero at masked positions, and carry no gradient.

Estimators (slime ``compute_advantages_and_returns`` in THUDM/slime
``slime/backends/megatron_utils/loss.py``, helpers in ``slime/utils/ppo_utils.py``):

    grpo, gspo, cispo             A_t = r                       (KL ignored: use a KL loss)
    reinforce_plus_plus           c_t = -kl_coef * kl_t + [t = last] * r
                                  A_t = G_t = c_t + gamma * G_{t+1}            arXiv:2501.03262
    reinforce_plus_plus_baseline  A_t = r - kl_coef * kl_t      (r already minus the group mean)
    ppo                           c_t as for reinforce_plus_plus,
                                  delta_t = c_t + gamma * V_{t+1} - V_t,   V_{T} = 0
                                  A_t = delta_t + gamma * lambd * A_{t+1}  (GAE, arXiv:1506.02438)
                                  returns R_t = A_t + V_t
    returns equal the advantages for every estimator but ppo.

"last" is the last trained token of the sample. Recursions over t (``G``, GAE) run over the
trained tokens only: a masked position is skipped, carrying G_{t+1}, A_{t+1} and V_{t+1} across it
(verl's ``compute_gae_advantage_return`` does the same for observation tokens).
Departures from slime, which index positions rather than trained tokens: for a mask that is a
prefix of ones (single-turn responses, right padding) the results are identical; where masked
spans sit inside a response (multi-turn tool output), slime still discounts over them, for ppo
bootstraps from their values and places the reward on the last response position even if that
one is masked. A fully masked sample gets zeros (slime asserts for reinforce_plus_plus).

``whiten`` implements ``--normalize-advantages`` on one process: (A - mean) / sqrt(var + 1e-8)
with the masked mean and Bessel-corrected variance over all trained tokens of the batch (slime
``distributed_masked_whiten`` in ``slime/utils/distributed_utils.py`` reduces the same sums over
the DP x CP group).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "gspo",
    "cispo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "ppo",
)


class AdvantagesAndReturns(NamedTuple):
    advantages: torch.Tensor  # [B, T], 0 at masked positions
    returns: torch.Tensor  # [B, T], 0 at masked positions


def _clean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` detached as float32 with masked positions set to 0, whatever they held (NaN, inf)."""
    return torch.where(mask, x.detach().float(), 0.0)


def _check(rewards: torch.Tensor, mask: torch.Tensor, **per_token: torch.Tensor | None) -> torch.Tensor:
    """Validate shapes; return the mask as bool ``[B, T]``."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards must be [B]={tuple(mask.shape[:1])}, got {tuple(rewards.shape)}")
    for name, x in per_token.items():
        if x is not None and x.shape != mask.shape:
            raise ValueError(f"{name} must match mask {tuple(mask.shape)}, got {tuple(x.shape)}")
    return mask.bool()


def _last_token_onehot(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool, true at the last trained token of each row (all false for an empty row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1, keepdim=True)  # [B, 1], -1 if empty
    return mask & (positions == last)


def _token_rewards(
    rewards: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """c_t = -kl_coef * kl_t + [t = last] * r, ``[B, T]`` float32, 0 at masked positions."""
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if kl is not None and kl_coef != 0:
        token_rewards = -kl_coef * _clean(kl, mask)
    final = rewards.detach().float()[:, None] * _last_token_onehot(mask)
    return token_rewards + final


def _discounted_cumsum(x: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """S_t = x_t + discount * S_{next trained token}, over trained tokens only; 0 when masked.

    x: ``[B, T]`` float, already 0 at masked positions. A plain loop over T: cheap next to a
    forward pass, and exact for any discount (no discount**-t rescaling).
    """
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[:, 0])  # [B]
    for t in reversed(range(x.shape[1])):
        running = torch.where(mask[:, t], x[:, t] + discount * running, running)
        out[:, t] = running
    return torch.where(mask, out, 0.0)


def grpo_advantages(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_t = r for every trained token (grpo, gspo, cispo).

    Args:
        rewards: ``[B]`` group-normalised rewards.
        mask: ``[B, T]`` trained tokens.
    Returns:
        ``[B, T]`` float32 advantages (also the returns).
    """
    mask = _check(rewards, mask)
    return torch.where(mask, rewards.detach().float()[:, None], 0.0)


def reinforce_plus_plus_returns(
    rewards: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor, *, kl_coef: float, gamma: float
) -> torch.Tensor:
    """REINFORCE++ discounted returns G_t (module docstring), used as advantages.

    Args:
        rewards: ``[B]`` raw rewards.
        kl: ``[B, T]`` per-token KL to the reference, or None for no penalty.
        mask: ``[B, T]`` trained tokens.
        kl_coef: weight of the KL penalty in the token rewards.
        gamma: discount per trained token.
    Returns:
        ``[B, T]`` float32 returns.
    """
    mask = _check(rewards, mask, kl=kl)
    return _discounted_cumsum(_token_rewards(rewards, kl, mask, kl_coef), mask, gamma)


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor, *, kl_coef: float
) -> torch.Tensor:
    """A_t = r - kl_coef * kl_t, with r already centred on its group mean.

    Args:
        rewards: ``[B]`` rewards minus their group mean.
        kl: ``[B, T]`` per-token KL to the reference, or None for no penalty.
        mask: ``[B, T]`` trained tokens.
        kl_coef: weight of the KL penalty.
    Returns:
        ``[B, T]`` float32 advantages (also the returns).
    """
    mask = _check(rewards, mask, kl=kl)
    advantages = grpo_advantages(rewards, mask)
    if kl is not None and kl_coef != 0:
        advantages = advantages - kl_coef * _clean(kl, mask)
    return advantages


def gae_advantages(
    rewards: torch.Tensor,
    kl: torch.Tensor | None,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    gamma: float,
    lambd: float,
) -> AdvantagesAndReturns:
    """PPO advantages by GAE over the token rewards, and returns A_t + V_t (module docstring).

    With gamma = lambd = 1 this is A_t = sum_{k >= t} c_k - V_t.

    Args:
        rewards: ``[B]`` raw rewards.
        kl: ``[B, T]`` per-token KL to the reference, or None for no penalty.
        values: ``[B, T]`` critic values of the response tokens.
        mask: ``[B, T]`` trained tokens.
        kl_coef, gamma, lambd: KL weight, discount and GAE lambda.
    Returns:
        ``AdvantagesAndReturns`` of ``[B, T]`` float32 tensors.
    """
    mask = _check(rewards, mask, kl=kl, values=values)
    token_rewards = _token_rewards(rewards, kl, mask, kl_coef)
    values = _clean(values, mask)
    advantages = torch.zeros_like(token_rewards)
    last_gae = torch.zeros_like(token_rewards[:, 0])  # A_{t+1}, [B]
    next_value = torch.zeros_like(token_rewards[:, 0])  # V_{t+1}, [B]; 0 after the last token
    for t in reversed(range(mask.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(m, delta + gamma * lambd * last_gae, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = last_gae
    advantages = torch.where(mask, advantages, 0.0)
    return AdvantagesAndReturns(advantages, torch.where(mask, advantages + values, 0.0))


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> AdvantagesAndReturns:
    """Advantages and returns of ``estimator`` (one of ``ESTIMATORS``), shapes as above.

    ``rewards`` must already be normalised as ``rewards.group_normalization_for(estimator)``
    says; ``values`` is required for ``ppo``. Whitening (``--normalize-advantages``) is left to
    the caller (``whiten``), since across data-parallel ranks it needs a collective.
    """
    if estimator in ("grpo", "gspo", "cispo"):
        advantages = grpo_advantages(rewards, mask)
    elif estimator == "reinforce_plus_plus":
        advantages = reinforce_plus_plus_returns(rewards, kl, mask, kl_coef=kl_coef, gamma=gamma)
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = reinforce_plus_plus_baseline_advantages(rewards, kl, mask, kl_coef=kl_coef)
    elif estimator == "ppo":
        if values is None:
            raise ValueError("the ppo estimator needs critic values")
        return gae_advantages(rewards, kl, values, mask, kl_coef=kl_coef, gamma=gamma, lambd=lambd)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    return AdvantagesAndReturns(advantages, advantages)


def whiten(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mu) / sqrt(var + eps) with mu, var over the trained tokens (var unbiased if n >= 2).

    Args:
        advantages: ``[B, T]`` (any shape matching ``mask``).
        mask: trained tokens; at least one must be set.
        eps: added to the variance, slime's 1e-8.
    Returns:
        float32 tensor of the input shape, 0 at masked positions.
    """
    mask = mask.bool()
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} and mask {tuple(mask.shape)} differ")
    n = mask.sum()
    if n == 0:
        raise ValueError("cannot whiten: the mask selects no token")
    x = _clean(advantages, mask)
    mean = x.sum() / n
    var = torch.where(mask, (x - mean).square(), 0.0).sum() / (n - 1).clamp_min(1)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + eps), 0.0)
