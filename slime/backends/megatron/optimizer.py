"""The Megatron optimizer (and, with the checkpoint work, its LR schedule) for DDP-wrapped model chunks.

One place builds it so that SFT, RL and checkpoint resume construct the identical optimizer.
"""

from __future__ import annotations

from typing import Any

import torch


def build_optimizer(models: list[torch.nn.Module], *, lr: float, clip_grad: float, weight_decay: float = 0.0,
                    adam_beta1: float = 0.9, adam_beta2: float = 0.98, adam_eps: float = 1e-8,
                    bf16: bool = False, optimizer: str = "adam") -> Any:
    """Megatron's optimizer for DDP-wrapped model chunks (Adam, or plain SGD without momentum;
    fp32 master weights under bf16)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    config = OptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1,
                             adam_beta2=adam_beta2, adam_eps=adam_eps, sgd_momentum=0.0, clip_grad=clip_grad,
                             bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    megatron_optimizer = get_megatron_optimizer(config, models)
    model_config = get_model_config(models[0])
    model_config.finalize_model_grads_func = finalize_model_grads  # DDP gradient sync before the step
    model_config.grad_scale_func = megatron_optimizer.scale_loss
    return megatron_optimizer
