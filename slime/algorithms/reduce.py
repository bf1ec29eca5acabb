"""Reduce per-token losses ``[B, T]`` over the trained tokens (``mask``) to one scalar.

Two reductions, as in slime (``get_sum_of_sample_mean`` in THUDM/slime
``slime/backends/megatron_utils/cp_utils.py``, scaled in ``loss_function`` of
``slime/backends/megatron_utils/loss.py``), with n_i = sum_t m_it the trained tokens of sample i:

    sample_mean (default)     sum_i [ sum_t m_it x_it / max(d_i, 1) ] / N     d_i = n_i by default
    token_mean                sum_i sum_t m_it x_it / D                       D = sum_i max(n_i, 1)
    (--calculate-per-token-loss)

Every sample weighs the same in ``sample_mean`` and every token in ``token_mean``, so long
responses dominate the latter. With one batch N = B; when an optimizer step is split into
micro-batches whose gradients are summed, pass the step's totals (``num_samples`` = samples in
the step, ``num_tokens`` = its D) so that the micro-batch results add up to the step's mean; slime
reaches the same by scaling with num_microbatches / step_global_batch_size x DP size, or by
Megatron's division by the step's token count. ``denominators`` replaces d_i: slime passes the
token total of the sample's whole rollout (``rollout_mask_sums``), so samples fanned out of one
rollout share one token-weighted mean.

Masked positions are selected away (``torch.where``), never multiplied by 0, so NaN or inf
there leave the result and its gradient finite.
"""

from __future__ import annotations

import torch


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension of the trained positions, ``[B, T] -> [B]``."""
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ")
    return torch.where(mask.bool(), values, 0.0).sum(dim=-1)


def per_sample_mean(
    values: torch.Tensor, mask: torch.Tensor, denominators: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of each sample's trained tokens: ``[B]`` with sum_t m_it x_it / max(d_i, 1).

    Args:
        values: ``[B, T]`` per-token values.
        mask: ``[B, T]`` trained tokens.
        denominators: optional ``[B]`` d_i; default n_i. A sample with no trained token gives 0.
    """
    if denominators is None:
        denominators = mask.bool().sum(dim=-1)
    return _masked_sum(values, mask) / denominators.clamp_min(1)


def sample_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_samples: int | None = None,
    denominators: torch.Tensor | None = None,
) -> torch.Tensor:
    """slime's default reduction: the per-sample means summed, divided by ``num_samples``.

    Args:
        values: ``[B, T]`` per-token values.
        mask: ``[B, T]`` trained tokens.
        num_samples: N; default B (the mean over this batch's samples).
        denominators: optional ``[B]`` per-sample denominators (see module docstring).
    Returns:
        0-dim tensor.
    """
    n = values.shape[0] if num_samples is None else num_samples
    return per_sample_mean(values, mask, denominators).sum() / n


def token_mean(
    values: torch.Tensor, mask: torch.Tensor, *, num_tokens: int | torch.Tensor | None = None
) -> torch.Tensor:
    """``--calculate-per-token-loss``: the sum over all trained tokens divided by ``num_tokens``.

    Args:
        values: ``[B, T]`` per-token values.
        mask: ``[B, T]`` trained tokens.
        num_tokens: D; default sum_i max(n_i, 1), slime's count (a sample with no trained
            token still counts 1).
    Returns:
        0-dim tensor.
    """
    if num_tokens is None:
        num_tokens = mask.bool().sum(dim=-1).clamp_min(1).sum()
    return _masked_sum(values, mask).sum() / num_tokens
