"""Megatron checkpoints in the artifact store: torch_dist directories committed by a manifest.

Layout (any fsspec-reachable local path; torch_dist itself writes to a local filesystem):

    {save}/iter_{N:07d}/model/        megatron-core dist_checkpointing (torch_dist) of the model
    {save}/iter_{N:07d}/manifest.json written last: iteration, model type, HF config, dtype, ...

A checkpoint exists only once its manifest does; `latest_checkpoint` returns the newest committed
iteration, so a crash mid-save leaves the previous checkpoint as the newest.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch
import torch.distributed as dist

from slime.errors import ConfigError, NotCommittedError
from slime.storage.manifest import Manifest, commit_directory, is_committed, producer_info, read_manifest

logger = logging.getLogger(__name__)

CHECKPOINT_KIND = "checkpoint"
_ITER = re.compile(r"^iter_(\d{7})$")


def iteration_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def latest_checkpoint(save: str) -> str | None:
    """The newest committed `iter_*` directory under `save`, or None."""
    if not os.path.isdir(save):
        return None
    iterations = sorted((int(m.group(1)), name) for name in os.listdir(save) if (m := _ITER.match(name)))
    for _, name in reversed(iterations):
        path = os.path.join(save, name)
        if is_committed(path):
            return path
    return None


def save_model_checkpoint(models: list[torch.nn.Module], save: str, iteration: int, *,
                          metadata: dict[str, Any], config_hash: str | None = None) -> Manifest:
    """Write the model as torch_dist under `{save}/iter_N/model` and commit the checkpoint."""
    from megatron.core import dist_checkpointing

    path = iteration_dir(save, iteration)
    if is_committed(path):
        raise ConfigError(f"{path} is already a committed checkpoint; use another --save or iteration")
    model_dir = os.path.join(path, "model")
    os.makedirs(model_dir, exist_ok=True)
    state = _bare(models[0]).sharded_state_dict()
    dist_checkpointing.save(state, model_dir)
    if dist.is_initialized():
        dist.barrier()
    if dist.is_initialized() and dist.get_rank() != 0:
        return read_manifest(path) if is_committed(path) else Manifest(kind=CHECKPOINT_KIND)
    manifest = commit_directory(path, CHECKPOINT_KIND, config_hash=config_hash,
                                producer=producer_info(stage="checkpoint"),
                                metadata={"iteration": iteration, "format": "torch_dist", **metadata})
    logger.info("committed checkpoint %s", path)
    return manifest


def load_model_checkpoint(models: list[torch.nn.Module], path: str) -> Manifest:
    """Load a committed checkpoint's model weights into `models` (built with the same config)."""
    from megatron.core import dist_checkpointing

    manifest = read_manifest(path)
    if manifest.kind != CHECKPOINT_KIND:
        raise NotCommittedError(f"{path} is a committed {manifest.kind!r}, not a checkpoint")
    model = _bare(models[0])
    state = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(path, "model"))
    model.load_state_dict(state)
    return manifest


def _bare(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / Float16 wrappers: checkpoints use its key space, so a checkpoint saved
    from a training (wrapped) model loads into a bare one and back."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)
