"""One optimizer step of a Megatron model on a batch of samples: SFT or policy loss.

The samples are split into micro-batches of `micro_batch_size`, run through megatron-core's
forward/backward schedule (gradients accumulate in the DDP buffers), then the Megatron optimizer
steps with gradient clipping. Losses follow `slime.algorithms`: per-token losses on response tokens
(loss mask applied), reduced over the whole step either per sample (mean of per-sample token means,
slime's default) or per token (`calculate_per_token_loss`). Each micro-batch's share is scaled by the
number of micro-batches, because the schedule divides every micro-batch loss by that number.

Data parallelism, dynamic batch sizes, LR schedules, value loss and KL terms come with the rest of the
Megatron-backend issue; this module is the single-rank core they build on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from slime.algorithms.policy_loss import policy_loss, sft_loss
from slime.backends.megatron.logprobs import PaddedBatch, pad_samples, response_log_probs
from slime.errors import ConfigError
from slime.types import Sample


@dataclass
class StepSettings:
    """What one train step needs to know besides the data."""

    loss_type: str = "sft_loss"  # sft_loss | policy_loss
    micro_batch_size: int = 1
    temperature: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    calculate_per_token_loss: bool = False


def _micro_batches(samples: list[Sample], size: int, pad_token_id: int, device: torch.device) -> list[dict[str, Any]]:
    batches = []
    for start in range(0, len(samples), size):
        chunk = samples[start : start + size]
        batch = pad_samples(chunk, pad_token_id, device)
        width = batch.max_response_length
        loss_mask = torch.zeros(len(chunk), width, dtype=torch.bool)
        advantages = torch.zeros(len(chunk), width)
        old_log_probs = torch.zeros(len(chunk), width)
        for row, sample in enumerate(chunk):
            n = sample.response_length
            mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
            loss_mask[row, :n] = torch.tensor(mask, dtype=torch.bool)
            advantage = (sample.metadata or {}).get("advantage")
            if advantage is not None:
                advantages[row, :n] = float(advantage)
            if sample.rollout_log_probs is not None:
                old_log_probs[row, :n] = torch.tensor(sample.rollout_log_probs)
        batches.append({"batch": batch, "loss_mask": loss_mask.to(device), "advantages": advantages.to(device),
                        "old_log_probs": old_log_probs.to(device)})
    return batches


def _loss(settings: StepSettings, vocab_size: int, denominator: float, num_microbatches: int,
          micro: dict[str, Any], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """Forward one micro-batch; return its output and the closure the schedule calls for the loss."""
    batch: PaddedBatch = micro["batch"]
    logp, response_mask, _ = response_log_probs(model, batch, vocab_size=vocab_size, temperature=settings.temperature)
    mask = response_mask & micro["loss_mask"]

    def loss_func(logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if settings.loss_type == "sft_loss":
            per_token = sft_loss(logp, mask)
            metrics = {"sft_loss": per_token.detach()}
        else:
            out = policy_loss(logp, micro["old_log_probs"], micro["advantages"], mask, eps_clip=settings.eps_clip,
                              eps_clip_high=settings.eps_clip_high, eps_clip_c=settings.eps_clip_c)
            per_token, metrics = out.loss, {"pg_clipfrac": out.clipfrac.detach(), "ppo_kl": out.ppo_kl.detach()}
        weights = mask.float()
        if not settings.calculate_per_token_loss:  # each sample's tokens weigh 1 / its token count
            weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=1)
        # sum of this micro-batch's share of the step loss; x num_microbatches undoes the schedule's division
        loss = (per_token * weights).sum() / denominator * num_microbatches
        reported = {name: ((value * weights).sum() / denominator).detach() for name, value in metrics.items()}
        return loss, reported

    return logp, loss_func


def train_step(models: list[torch.nn.Module], optimizer: Any, samples: list[Sample], settings: StepSettings, *,
               vocab_size: int, pad_token_id: int = 0) -> dict[str, float]:
    """Accumulate gradients over all samples and take one optimizer step; returns step metrics."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if settings.loss_type not in ("sft_loss", "policy_loss"):
        raise ConfigError(f"loss_type {settings.loss_type!r} is not supported by the train step yet")
    if not samples:
        raise ConfigError("train_step needs at least one sample")
    device = next(models[0].parameters()).device
    micro = _micro_batches(samples, settings.micro_batch_size, pad_token_id, device)
    if settings.calculate_per_token_loss:
        denominator = float(max(1, sum(int(m["loss_mask"].sum()) for m in micro)))
    else:
        denominator = float(len(samples))
    for model in models:
        model.train()
        model.zero_grad_buffer()
    optimizer.zero_grad()
    forward_step = partial(_forward_step, settings, vocab_size, denominator, len(micro))
    width = max(m["batch"].tokens.shape[1] for m in micro)
    reduced = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=models, num_microbatches=len(micro),
        seq_length=width, micro_batch_size=settings.micro_batch_size, forward_only=False)
    updated, grad_norm, _ = optimizer.step()
    metrics: dict[str, float] = {"grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                                 "update_successful": float(bool(updated))}
    for name in reduced[0] if reduced else []:
        metrics[name] = float(sum(r[name] for r in reduced))
    metrics["lr"] = optimizer.param_groups[0]["lr"]
    return metrics


def _forward_step(settings: StepSettings, vocab_size: int, denominator: float, num_microbatches: int,
                  data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    return _loss(settings, vocab_size, denominator, num_microbatches, next(data_iterator), model)
