"""Per-token approximate KL divergence KL(pi || pi_ref) from sampled log-probabilities.

With ``log_ratio = log pi(x) - log pi_ref(x)`` for a token x sampled from pi (Schulman,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):

    k1         = log_ratio                                  unbiased, can be negative
    k2         = log_ratio**2 / 2                           biased, low variance, >= 0
    k3         = exp(-log_ratio) - 1 + log_ratio            unbiased, low variance, >= 0
    low_var_kl = clamp(k3, -10, 10)                         k3 with a clamp for stability

The clamp is applied to ``low_var_kl`` only, as slime does (``compute_approx_kl`` in
THUDM/slime ``slime/utils/ppo_utils.py``); the arithmetic runs in float32 as there.
slime's optional importance ratio for the unbiased KL (``--use-unbiased-kl``) is applied by the train
step (``slime.backends.megatron.train``): the result times ``exp(log_probs - old_log_probs)``.
"""

from __future__ import annotations

import torch

KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")

# Bound of the low_var_kl clamp (slime's value).
LOW_VAR_KL_CLAMP = 10.0


def compute_approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Elementwise KL estimate between the policy and a reference policy.

    Args:
        log_probs: log pi of the sampled tokens, any shape (e.g. ``[B, T]``).
        ref_log_probs: log pi_ref of the same tokens, same shape.
        kl_type: one of ``KL_TYPES``; formulas in the module docstring.

    Returns:
        float32 tensor of the input shape. No masking is applied: reduce it with ``reduce``.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_type!r}; valid: {', '.join(KL_TYPES)}")
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio.square() / 2.0
    k3 = torch.expm1(-log_ratio) + log_ratio  # exp(-x) - 1 + x, accurate near x = 0
    if kl_type == "low_var_kl":
        return k3.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return k3
