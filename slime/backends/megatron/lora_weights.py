"""Where a LoRA model's weights come from: the frozen base, the starting adapters, the KL reference.

A LoRA checkpoint holds adapters only, so every stage first fills the base, then the adapters:

* base: `checkpoint.load` when it is a full (non-LoRA) checkpoint (e.g. a full SFT or a conversion);
  else the base recorded in the LoRA checkpoint the adapters start from (the pipeline's LoRA SFT trained
  on the conversion); else `checkpoint.ref_load` (its iteration `ref_ckpt_step` when set); else `checkpoint.hf_checkpoint`. On a resume,
  the base recorded in the checkpoint being resumed (its content hash is checked on load).
* starting adapters: `checkpoint.load` when it is a LoRA checkpoint (the pipeline's LoRA SFT), else
  `lora.lora_adapter_path`, else fresh ones (B = 0).
* KL reference: the policy the stage starts from, in the same model: base + the starting adapters, kept
  as a copy of the adapter tensors (megabytes, not a second model), or the base alone (adapters off).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from slime.backends.megatron import lora
from slime.errors import ConfigError
from slime.storage.fs import is_hf_dir

logger = logging.getLogger(__name__)


def lora_checkpoint(path: str | None) -> str | None:
    """The committed checkpoint `path` names when it holds LoRA adapters, else None."""
    from slime.backends.megatron.checkpoint import resolve_checkpoint
    from slime.backends.megatron.megatron_lm import is_megatron_lm_checkpoint
    from slime.storage import is_committed, read_manifest

    if not path or (not is_committed(path) and is_hf_dir(path)):
        return None
    resolved = resolve_checkpoint(path)
    if is_megatron_lm_checkpoint(resolved):  # a Megatron-LM / slime checkpoint holds full weights: a base
        return None
    return resolved if read_manifest(resolved).metadata.get("lora") else None


def base_source(config: Any) -> str:
    """The base weights a LoRA stage starts on (module docstring)."""
    from slime.backends.megatron.checkpoint import reference_checkpoint, resolve_checkpoint

    ck = config.checkpoint
    if ck.load and not lora_checkpoint(ck.load):
        return resolve_checkpoint(ck.load)
    adapters = adapter_source(config)
    if adapters is not None:
        return recorded_base(adapters)
    if ck.ref_load:
        ref = reference_checkpoint(ck)  # its iteration ref_ckpt_step when set
        if lora_checkpoint(ref):
            raise ConfigError(f"checkpoint.ref_load {ref} holds LoRA adapters: with LoRA the KL reference "
                              "is the base (+ the starting adapters); pass the adapters as --load or "
                              "--lora-adapter-path")
        return ref
    config.require("checkpoint.hf_checkpoint", stage="lora")
    return ck.hf_checkpoint


def adapter_source(config: Any) -> str | None:
    """The LoRA checkpoint the adapters start from, or None for fresh adapters."""
    adapters = lora_checkpoint(config.checkpoint.load)
    if adapters is None and config.lora.lora_adapter_path:
        adapters = lora_checkpoint(config.lora.lora_adapter_path)
        if adapters is None:
            raise ConfigError(f"lora.lora_adapter_path {config.lora.lora_adapter_path}: not a committed LoRA "
                              "checkpoint (an iter_* directory, or a --save root holding one, saved with LoRA)")
    return adapters


def recorded_base(path: str) -> str:
    """The base source recorded in the LoRA checkpoint at `path` (the one its adapters belong to)."""
    from slime.storage import read_manifest

    saved = read_manifest(path).metadata.get("lora") or {}
    if not (saved.get("base") or {}).get("source"):
        raise ConfigError(f"{path} is not a LoRA checkpoint with a recorded base; resume it without LoRA")
    return saved["base"]["source"]


def load_base(bridge: Any, models: list[torch.nn.Module], source: str) -> None:
    """Fill the frozen base of `models` from `source` (HF directory or full checkpoint), record it."""
    from slime.backends.megatron.checkpoint import load_model_checkpoint

    if is_hf_dir(source):
        bridge.load_weights(models, source)
    else:
        load_model_checkpoint(models, source)
    lora.set_base(models, source)
    logger.info("LoRA base weights from %s", source)


def start_weights(bridge: Any, models: list[torch.nn.Module], config: Any) -> dict[str, torch.Tensor] | None:
    """Base and starting adapters of a stage that does not resume; returns the reference adapters (a copy of
    the starting ones, or None when they are fresh: the reference is then the base alone)."""
    from slime.backends.megatron.checkpoint import load_model_checkpoint

    load_base(bridge, models, base_source(config))
    adapters = adapter_source(config)
    if adapters is None:
        return None
    load_model_checkpoint(models, adapters)
    logger.info("LoRA adapters from %s", adapters)
    return lora.adapter_tensors(models)


def reference_snapshot(models: list[torch.nn.Module], config: Any) -> dict[str, torch.Tensor] | None:
    """The starting adapters again, for a stage that resumed (its model holds the trained ones): loaded,
    copied, and the trained adapters put back. None when the stage started from fresh adapters."""
    from slime.backends.megatron.checkpoint import load_model_checkpoint

    adapters = adapter_source(config)
    if adapters is None:
        return None
    trained = lora.adapter_tensors(models)
    load_model_checkpoint(models, adapters)
    snapshot = lora.adapter_tensors(models)
    with torch.no_grad():
        params = dict(lora.named_adapters(models))
        for name, value in trained.items():
            params[name].copy_(value)
    return snapshot
