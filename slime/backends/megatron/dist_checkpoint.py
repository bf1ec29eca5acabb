"""The torch_dist pieces both checkpoint layouts share: this project's (checkpoint.py) and Megatron-LM's and
slime's (megatron_lm.py): the save strategy and its writer count, the record of what a load restored besides
tensors, the LR-schedule check and the one-model-chunk rule. Kept below both so neither imports the other's
internals."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from slime.backends.megatron.optimizer import SCHEDULER_FIELDS
from slime.errors import CheckpointMismatchError, ConfigError
from slime.storage.manifest import Manifest


@dataclass
class TrainingState:
    """What `load_checkpoint` restored besides tensors: the iteration and the caller's `extra_state`."""

    iteration: int
    extra_state: dict[str, Any] = field(default_factory=dict)
    manifest: Manifest | None = None


def save_strategy() -> Any:
    """megatron-core's torch_dist writer with `save_threads()` files per rank, each written by its own
    process; with data parallelism, wrapped to spread the replicated tensors' writes over the DP ranks
    (Megatron's --ckpt-fully-parallel-save, its default) instead of DP rank 0 writing them all."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=save_threads())
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_data_parallel_world_size() > 1:
        return FullyParallelSaveStrategyWrapper(strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    return strategy


def save_threads() -> int:
    """Writer processes per rank and torch_dist directory: half this node's cores, 2 to 8 (megatron's default,
    2, leaves a fast local disk idle: docs/benchmarks.md "Checkpoint saves")."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def check_scheduler(saved: dict[str, Any] | None, current: dict[str, Any], path: str) -> None:
    """Refuse a resume whose LR schedule differs from the checkpoint's (naming the field and the config key)."""
    if saved is None:
        raise CheckpointMismatchError(f"{path} was saved without an LR scheduler; resume it without one")
    for name, source in SCHEDULER_FIELDS.items():
        if saved.get(name) != current.get(name):
            raise CheckpointMismatchError(f"{path}: LR schedule {name} is {saved.get(name)!r} in the checkpoint but "
                                          f"{current.get(name)!r} now (from {source}); resume with the same schedule")


def single_chunk(models: list[torch.nn.Module]) -> torch.nn.Module:
    """The model inside DDP / Float16 wrappers: checkpoints use its key space, so a checkpoint saved
    from a training (wrapped) model loads into a bare one and back."""
    from megatron.core.utils import unwrap_model

    if len(models) != 1:
        raise ConfigError(f"checkpoints support one model chunk (no virtual pipeline stages); got {len(models)}")
    return unwrap_model(models[0])
