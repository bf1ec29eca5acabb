"""Forward-only passes over micro-batches through megatron-core's schedule (no gradients).

Used for what the trainer scores but does not train on: reference-model and old-policy log-probs,
entropies, critic values. Going through `get_forward_backward_func` (rather than calling the model in
a loop) keeps one code path with the train step, so pipeline parallelism can later slot in here.
Pipeline parallelism > 1 is refused for now: the per-sample outputs live on the last stage only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from slime.errors import ConfigError


def check_single_stage() -> None:
    """Refuse pipeline parallelism, which the train step and forward passes do not support yet."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ConfigError("the Megatron train step does not support pipeline parallelism > 1 yet")


def forward_only(models: list[torch.nn.Module], micro_batches: list[Any],
                 forward: Callable[[torch.nn.Module, Any], Any],
                 wrap: Callable[[Iterator[Any]], Iterator[Any]] | None = None) -> list[Any]:
    """`forward(model, micro_batch)` for every micro-batch in eval mode without autograd; the results
    in micro-batch order. `wrap` wraps the micro-batch iterator the schedule draws from (a profiler)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    check_single_stage()
    results: list[Any] = []
    device = next(models[0].parameters()).device

    def step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        results.append(forward(model, next(data_iterator)))
        # the schedule wants a loss; the outputs are collected above
        return torch.zeros((), device=device), lambda output: (output, {})

    for model in models:
        model.eval()
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=step, data_iterator=wrap(iter(micro_batches)) if wrap
                                    else iter(micro_batches), model=models,
                                    num_microbatches=len(micro_batches), seq_length=1, micro_batch_size=1,
                                    forward_only=True)
    return results
