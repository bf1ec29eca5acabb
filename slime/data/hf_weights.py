"""Write HF safetensors checkpoints from (name, tensor) pairs, sharded as transformers does, one shard at a time.

`save_hf_weights` is the one writer of HF weights in the project: the Megatron export and weight syncs
(slime/backends/megatron/hf_export.py re-exports it) and the generated kits' large random models (tiny.py,
`model.dtype: bfloat16`). Tensors are written shard by shard as they arrive, so at most one shard's tensors
are held at once: `model.safetensors` when everything fits in one shard, else
`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json` (`{"metadata": {"total_size": bytes},
"weight_map": {name: file}}`), the layout `from_pretrained` and mbridge read. A shard is written under a
temporary name and renamed once the shard count is known.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch
from safetensors.torch import save_file

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
INDEX_FILE = "model.safetensors.index.json"


def save_hf_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Save tensors as `model.safetensors`, or as `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json` when they exceed `max_shard_bytes` (a tensor larger than that gets a shard
    of its own). Returns the file names."""
    os.makedirs(out_dir, exist_ok=True)
    written: list[tuple[str, list[str]]] = []  # (temporary file, names in it)
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        temp = os.path.join(out_dir, f".shard-{len(written) + 1:05d}.safetensors.tmp")
        save_file(shard, temp, metadata={"format": "pt"})
        written.append((temp, list(shard)))
        shard.clear()

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    if shard or not written:
        flush()
    if len(written) == 1:
        os.replace(written[0][0], os.path.join(out_dir, "model.safetensors"))
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, (temp, keys) in enumerate(written, start=1):
        name = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        os.replace(temp, os.path.join(out_dir, name))
        names.append(name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return [*names, INDEX_FILE]
