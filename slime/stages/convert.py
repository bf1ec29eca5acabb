"""Stage `convert`: a Hugging Face checkpoint -> a Megatron torch_dist checkpoint (through mbridge).

    slime convert --hf-checkpoint runs/tiny-kit/model --save runs/exp/convert/checkpoint
    python -m slime.stages.convert --config deployments/tiny-cpu.yaml

The result is iteration 0 of `--save`, committed with a manifest recording the model type, the HF
config, the dtype and the source directory, so `export` and training can rebuild the same model.
Precision: fp32 unless the Megatron flag `--bf16` is set.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from slime.config import Config
from slime.errors import ConfigError
from slime.storage.staging import staged


def megatron_dtype(config: Config) -> torch.dtype:
    return torch.bfloat16 if config.megatron.get("bf16") else torch.float32


def vocab_padding(config: Config, hf_dir: str) -> int:
    """`make_bridge`'s make_vocab_size_divisible_by: Megatron's --padded-vocab-size (slime passes it to the
    model as its vocabulary size) as the one multiple that rounds the HF vocabulary up to exactly that size,
    else --make-vocab-size-divisible-by (Megatron's default 128)."""
    from slime.backends.megatron.bridge import load_hf_config

    padded = config.megatron.get("padded_vocab_size")
    if padded is None:
        return int(config.megatron.get("make_vocab_size_divisible_by", 128))
    vocab = load_hf_config(hf_dir).vocab_size
    tp = int(config.megatron.get("tensor_model_parallel_size", 1))
    if not isinstance(padded, int) or padded < vocab or padded % tp:
        raise ConfigError(f"megatron.padded_vocab_size {padded!r}: must be an integer >= the vocabulary of {hf_dir} "
                          f"({vocab}) and a multiple of tensor_model_parallel_size ({tp})")
    return padded


def run_convert(config: Config) -> dict[str, Any]:
    """Convert `checkpoint.hf_checkpoint` into `checkpoint.save`; returns the checkpoint path and hash."""
    config.require("checkpoint.hf_checkpoint", "checkpoint.save", stage="convert")
    with staged(config) as (local, staging):  # a remote save: written locally, uploaded after
        result = _convert(local)
    return {**result, "checkpoint": staging.to_remote(result["checkpoint"])}


def _convert(config: Config) -> dict[str, Any]:
    from slime.backends.megatron.bridge import build_model, checkpoint_metadata, init_megatron, make_bridge
    from slime.backends.megatron.checkpoint import iteration_dir, save_model_checkpoint
    from slime.storage import manifest_hash

    hf_dir, save = config.checkpoint.hf_checkpoint, config.checkpoint.save
    dtype = megatron_dtype(config)
    init_megatron(seed=config.run.seed, megatron=config.megatron)
    bridge = make_bridge(hf_dir, dtype, vocab_padding(config, hf_dir), config.megatron)
    models = build_model(bridge, hf_dir)
    save_model_checkpoint(models, save, 0, config_hash=config.section_hash("checkpoint", "megatron"),
                          metadata={**checkpoint_metadata(bridge, hf_dir), "stage": "convert"})
    path = iteration_dir(save, 0)
    return {"checkpoint": path, "manifest_hash": manifest_hash(path)}


if __name__ == "__main__":
    from slime.cli import main

    sys.exit(main(["convert", *sys.argv[1:]]))
