"""Write HF safetensors checkpoints from (name, tensor) pairs, sharded like transformers does."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch
from safetensors.torch import save_file

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def save_hf_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Save tensors as `model.safetensors`, or as `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json` when they exceed `max_shard_bytes`. Returns the file names."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    os.makedirs(out_dir, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        names.append(name)
        for key, tensor in shard.items():
            weight_map[key] = name
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return [*names, "model.safetensors.index.json"]
