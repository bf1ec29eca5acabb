"""`--normalize-advantages` over the data-parallel group: one mean and variance for the global batch.

`slime.algorithms.advantages.whiten` whitens one process's tokens; when each DP rank holds a share of
the batch, the statistics must cover every rank's trained tokens or the update would depend on the
split (slime: `distributed_masked_whiten`). Two all-reduces: the token sum and count give the mean,
then the sum of squared deviations gives the (Bessel-corrected) variance: `whiten`'s two-pass formula,
accumulated in float64, so one rank agrees with `whiten` to fp32 rounding.
"""

from __future__ import annotations

import torch

from slime.types import Sample


def _trained(sample: Sample) -> torch.Tensor:
    if sample.loss_mask is None:
        return torch.ones(sample.response_length, dtype=torch.bool)
    return torch.tensor(sample.loss_mask, dtype=torch.bool)


def whiten_over_dp(samples: list[Sample], advantages: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """(A - mean) / sqrt(var + eps) per sample (1-D float32 CPU tensors, 0 at untrained tokens), with
    mean and var over the trained tokens of all data-parallel ranks' samples."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group() if parallel_state.get_data_parallel_world_size() > 1 else None
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    masks = [_trained(s) for s in samples]
    values = [torch.where(m, torch.as_tensor(a, dtype=torch.float32).cpu(), 0.0) for a, m in
              zip(advantages, masks, strict=True)]
    totals = torch.tensor([sum(float(v.double().sum()) for v in values), sum(int(m.sum()) for m in masks)],
                          dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(totals, group=group)
    if totals[1] == 0:
        raise ValueError("cannot whiten advantages: no trained token on any data-parallel rank")
    mean = totals[0] / totals[1]
    squares = torch.tensor([sum(float(torch.where(m, v.double() - mean.cpu(), 0.0).square().sum())
                                for v, m in zip(values, masks, strict=True))], dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(squares, group=group)
    var = squares[0] / max(float(totals[1]) - 1, 1.0)
    scale = float(torch.rsqrt(var + eps))
    return [torch.where(m, ((v.double() - mean.cpu()) * scale).float(), 0.0) for v, m in
            zip(values, masks, strict=True)]
