"""Forward-only passes over micro-batches through megatron-core's schedule (no gradients), and what
pipeline parallelism needs around the schedule.

Used for what the trainer scores but does not train on: reference-model and old-policy log-probs,
entropies, critic values. Going through `get_forward_backward_func` (rather than calling the model in
a loop) keeps one code path with the train step and gives pipeline parallelism (PP) for free: with PP,
megatron's 1F1B schedule sends each micro-batch's hidden states from stage to stage (point-to-point
over the pipeline group), and only the last stage holds the model's output. So a pass is split in two:
`run(model, micro_batch)` calls the model (on every stage), `collect(micro_batch, output)` turns the
last stage's output into results; `share_from_last_stage` then copies per-sample values to the other
stages, since callers expect them on every rank.

Micro-batches differ in width (samples are padded per micro-batch), so the model config gets
`variable_seq_lengths`: the p2p exchange sends each tensor's shape before the tensor.
Virtual pipeline stages (interleaved 1F1B, several model chunks per rank) are refused. A model built with
CUDA graphs (`cuda_graphs.py`) runs these passes eagerly: the graphs are the train step's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.megatron import cuda_graphs
from slime.errors import ConfigError


def pipeline_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def prepare_schedule(models: list[torch.nn.Module]) -> None:
    """Refuse virtual pipeline stages; let pipeline stages exchange micro-batches of any width."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    if len(models) != 1 or (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
        raise ConfigError("virtual pipeline stages (--num-layers-per-virtual-pipeline-stage / "
                          "virtual_pipeline_model_parallel_size) are not supported by the Megatron backend: "
                          f"it runs one model chunk per rank, got {len(models)}")
    if pipeline_size() > 1:
        config = get_model_config(models[0])
        config.variable_seq_lengths = True
        if config.pipeline_dtype is None:  # the dtype of the hidden states sent between stages
            config.pipeline_dtype = config.params_dtype


def broadcast_from_last_stage(payload: Any) -> Any:
    """A small picklable object (metrics) from the last pipeline stage to every stage of this rank's
    pipeline group; unchanged without pipeline parallelism."""
    from megatron.core import parallel_state

    if pipeline_size() == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return box[0]


def share_from_last_stage(values: list[torch.Tensor] | None, lengths: list[int],
                          device: torch.device) -> list[torch.Tensor]:
    """Per-sample 1-D float32 CPU tensors of `lengths`, held by the last stage (`values`; None
    elsewhere), on every stage of the pipeline group: one flat broadcast (every rank knows the lengths)."""
    from megatron.core import parallel_state

    if pipeline_size() == 1:
        return values
    total = sum(lengths)
    flat = (torch.cat(values).to(device=device, dtype=torch.float32) if is_last_stage()
            else torch.empty(total, dtype=torch.float32, device=device))
    dist.broadcast(flat, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return list(flat.cpu().split(lengths))


def forward_only(models: list[torch.nn.Module], micro_batches: list[Any],
                 run: Callable[[torch.nn.Module, Any], torch.Tensor],
                 collect: Callable[[Any, torch.Tensor], Any],
                 wrap: Callable[[Iterator[Any]], Iterator[Any]] | None = None) -> list[Any]:
    """`collect(micro_batch, run(model, micro_batch))` for every micro-batch, in eval mode without
    autograd; the results in micro-batch order on the last pipeline stage, an empty list on the
    others. `wrap` wraps the micro-batch iterator the schedule draws from (a profiler)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    prepare_schedule(models)
    results: list[Any] = []
    device = next(models[0].parameters()).device

    def step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        micro = next(data_iterator)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            results.append(collect(micro, output))
            return torch.zeros((), device=device), {}  # the schedule wants a loss; results are kept above

        return run(model, micro), loss_func

    for model in models:
        model.eval()
    with torch.no_grad(), cuda_graphs.eager(models):  # a train step's graphs are not replayed here
        get_forward_backward_func()(forward_step_func=step, data_iterator=wrap(iter(micro_batches)) if wrap
                                    else iter(micro_batches), model=models,
                                    num_microbatches=len(micro_batches), seq_length=1, micro_batch_size=1,
                                    forward_only=True)
    return results
