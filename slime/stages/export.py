"""Stage `export`: a Megatron checkpoint -> an HF safetensors directory for transformers and SGLang.

    slime export --load runs/exp/rl/checkpoints --output-dir runs/exp/export/hf [--origin-hf-dir DIR]
    python -m slime.stages.export --config deployments/tiny-cpu.yaml

`--load` is a checkpoint directory (`iter_NNNNNNN`) or a `--save` root (its newest committed
iteration). The model is rebuilt from the HF config recorded at conversion, the weights are mapped
back through mbridge with the padded vocabulary rows removed, and the config, generation config and
tokenizer files are copied from the origin HF directory. The output is committed with a manifest.
GLM-4.5's MTP layers, which are not trained here, are copied unchanged from the origin HF checkpoint
(`glm4_moe.carried_mtp_weights`; the manifest lists them as `carried_from_origin`).

A LoRA checkpoint (adapters only, docs/lora.md) is exported on the base it records: merged weights
(base + scale * B @ A) as a plain HF directory, or with `--merge false` a PEFT adapter directory
(`adapter_config.json`, `adapter_model.safetensors`, the tokenizer files) for `peft.PeftModel.from_pretrained`,
whose `base_model_name_or_path` is the model the adapters were trained on (`lora_export.peft_base`: a trained
Megatron checkpoint as base is named as such, with a warning in the manifest and the result, docs/lora.md).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import torch

from slime.config import Config
from slime.errors import ConfigError, NotCommittedError
from slime.storage.fs import is_hf_dir
from slime.storage.staging import staged

logger = logging.getLogger(__name__)

# files of an HF directory that describe the model rather than hold its weights
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                  "tokenizer.model", "added_tokens.json")


def run_export(config: Config) -> dict[str, Any]:
    """Export `checkpoint.load` to `export.output_dir`; returns the output path and its manifest hash."""
    config.require("checkpoint.load", "export.output_dir", stage="export")
    with staged(config) as (local, staging):  # remote --load / --output-dir: local copies, the export uploaded after
        result = _export(local, staging.to_remote)
    return {**result, **{key: staging.to_remote(result[key]) for key in ("hf_dir", "megatron_lm_dir",
                                                                         "source_checkpoint") if key in result}}


def _export(config: Config, remote: Callable[[str], str] = str) -> dict[str, Any]:
    """The export on local paths; `remote` names a staged checkpoint by its URL in the manifest."""
    from slime.backends.megatron.bridge import build_model, export_hf_weights, init_megatron, make_bridge
    from slime.backends.megatron.checkpoint import load_model_checkpoint, resolve_checkpoint
    from slime.backends.megatron.glm4_moe import carried_mtp_weights, mtp_weight_names
    from slime.backends.megatron.hf_export import save_hf_weights
    from slime.backends.megatron.megatron_lm import (
        TRACKER,
        is_megatron_lm_checkpoint,
        read_megatron_lm_checkpoint,
    )
    from slime.stages.convert import vocab_padding
    from slime.storage import commit_directory, is_committed, manifest_hash, read_manifest

    path = resolve_checkpoint(config.checkpoint.load)
    if is_megatron_lm_checkpoint(path):  # a Megatron-LM / slime checkpoint: what its args say (no manifest)
        ckpt = read_megatron_lm_checkpoint(path)
        meta = {"dtype": "bfloat16" if ckpt.arg("bf16") else "float32", "iteration": ckpt.iteration,
                "padded_vocab_size": ckpt.arg("padded_vocab_size")}
    else:
        meta = read_manifest(path).metadata
    origin = config.export.origin_hf_dir or meta.get("origin_hf_dir")
    if not origin or not os.path.isfile(os.path.join(origin, "config.json")):
        raise ConfigError(f"export needs the origin HF directory (config and tokenizer): {origin!r} has no "
                          "config.json; pass --origin-hf-dir")
    out = config.export.output_dir
    if is_committed(out) or os.path.isfile(os.path.join(out, TRACKER)):
        raise ConfigError(f"{out} already holds a committed export; choose another --output-dir")
    dtype = torch.bfloat16 if meta.get("dtype") == "bfloat16" else torch.float32
    init_megatron(seed=config.run.seed, megatron=config.megatron)
    # the checkpoint's own vocabulary rows (Megatron's padded size, recorded at save) decide the model's shape
    bridge = make_bridge(origin, dtype, meta.get("padded_vocab_size") or vocab_padding(config, origin),
                         config.megatron)
    if config.export.megatron_lm_layout:
        return _export_megatron_lm(config, bridge, path, meta, out, remote)
    saved_lora = meta.get("lora")
    if saved_lora:
        return _export_lora(config, bridge, path, {**saved_lora, "iteration": meta.get("iteration")}, origin, out,
                            remote)
    models = build_model(bridge)
    load_model_checkpoint(models, path)
    carried = mtp_weight_names(origin, bridge.hf_config)  # GLM-4.5's MTP layers: not trained here, copied
    weights = itertools.chain(export_hf_weights(bridge, models), carried_mtp_weights(origin, bridge.hf_config))
    files = save_hf_weights(weights, out)
    for name in _HF_SIDE_FILES:
        if os.path.isfile(os.path.join(origin, name)):
            shutil.copyfile(os.path.join(origin, name), os.path.join(out, name))
    extra = {"carried_from_origin": carried} if carried else {}
    if carried:
        logger.info("%s: %d MTP tensors copied unchanged from %s (not trained here)", out, len(carried), origin)
    commit_directory(out, "hf_model", metadata={"source_checkpoint": remote(path), "iteration": meta.get("iteration"),
                                                "weights": files, "origin_hf_dir": origin, **extra})
    return {"hf_dir": out, "manifest_hash": manifest_hash(out), "source_checkpoint": path, **extra}


def _export_megatron_lm(config: Config, bridge: Any, path: str, meta: dict[str, Any], out: str,
                        remote: Callable[[str], str]) -> dict[str, Any]:
    """`--megatron-lm-layout`: the checkpoint in Megatron-LM's / slime's torch_dist layout (megatron_lm.py), for their
    `--load`. This process is one rank, so the per-rank state (optimizer shards, RNG) goes along only from a
    checkpoint saved by one rank; from any other the weights alone (marked --no-save-optim / --no-save-rng).
    The root is committed with a manifest too (ignored by Megatron-LM; here it records the export)."""
    from slime.backends.megatron.bridge import build_model
    from slime.backends.megatron.checkpoint import TRAINING_STATE, load_checkpoint, load_model_checkpoint
    from slime.backends.megatron.megatron_lm import SLIME_CURSOR, save_megatron_lm_checkpoint
    from slime.backends.megatron.optimizer import build_config_optimizer
    from slime.storage import commit_directory, manifest_hash

    parallel = meta.get("parallel") or {}
    one_rank = all(parallel.get(k) == 1 for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                  "data_parallel_size"))
    iteration = int(meta.get("iteration") or 0)
    if meta.get("training_state") and one_rank and not meta.get("lora"):
        distributed = bool(parallel.get("use_distributed_optimizer"))
        models = build_model(bridge, wrap_with_ddp=True, use_distributed_optimizer=distributed)
        optimizer = build_config_optimizer(models, config, distributed)
        state = load_checkpoint(models, path, optimizer)  # weights, Adam state, this rank's RNG; the schedule below
        with open(os.path.join(path, TRAINING_STATE)) as f:
            schedule = json.load(f).get("scheduler")
        written = save_megatron_lm_checkpoint(
            models, out, iteration, optimizer=optimizer if schedule else None, scheduler_state=schedule,
            samples_per_step=config.train.global_batch_size,
            fully_reshardable=meta.get("optimizer_sharding") == "fully_reshardable", with_rng=bool(schedule))
        cursor = state.extra_state.get("data_source")
        if cursor:  # slime's own file (a torch.save of plain ints, as its data source writes and reads it)
            os.makedirs(os.path.join(out, "rollout"), exist_ok=True)
            torch.save({k: cursor[k] for k in ("sample_offset", "epoch_id", "sample_group_index", "sample_index")}
                       | {"metadata": {}}, os.path.join(out, SLIME_CURSOR.format(iteration=iteration)))
    else:
        logger.warning("%s: %s; the Megatron-LM checkpoint holds the weights only", path,
                       "a model-only checkpoint" if not meta.get("training_state") else
                       f"per-rank state of {parallel} does not fit this one-rank export")
        models = build_model(bridge)
        load_model_checkpoint(models, path)
        written = save_megatron_lm_checkpoint(models, out, iteration, with_rng=False)
    commit_directory(out, "megatron_lm_checkpoint", metadata={"source_checkpoint": remote(path), "iteration": iteration,
                                                             "checkpoint": os.path.relpath(written, out)})
    return {"megatron_lm_dir": out, "manifest_hash": manifest_hash(out), "iteration": iteration,
            "source_checkpoint": path}


def _export_lora(config: Config, bridge: Any, path: str, saved: dict[str, Any], origin: str, out: str,
                 remote: Callable[[str], str]) -> dict[str, Any]:
    """A LoRA checkpoint on its recorded base: merged HF weights, or (merge false) a PEFT adapter directory
    whose `base_model_name_or_path` is that base (`lora_export.peft_base`, a warning when it is no HF model)."""
    from slime.backends.megatron.bridge import build_model, export_hf_weights
    from slime.backends.megatron.checkpoint import load_model_checkpoint
    from slime.backends.megatron.hf_export import save_hf_weights
    from slime.backends.megatron.lora import LoraSpec, lora_callback
    from slime.backends.megatron.lora_export import peft_base, save_peft_adapter
    from slime.backends.megatron.lora_weights import load_base
    from slime.storage import commit_directory, manifest_hash

    spec = LoraSpec(rank=saved["rank"], alpha=saved["alpha"], dropout=saved.get("dropout", 0.0),
                    targets=tuple(saved["targets"]))
    models = build_model(bridge, post_create=lora_callback(spec))
    load_base(bridge, models, saved["base"]["source"])
    load_model_checkpoint(models, path)
    extra: dict[str, Any] = {}
    if config.export.merge:
        kind, files = "hf_model", save_hf_weights(export_hf_weights(bridge, models), out)
    else:
        base = peft_base(saved["base"]["source"])
        save_peft_adapter(bridge, models, out, base_model=base["base_model_name_or_path"])
        kind, files = "peft_adapter", sorted(os.listdir(out))
        extra["peft_base"] = {**base, "lora_base": remote(base["lora_base"])}
        if "warning" in base:
            logger.warning("%s: %s", out, base["warning"])
    for name in _HF_SIDE_FILES:  # a PEFT directory's config is its adapter_config.json
        if (name != "config.json" or kind == "hf_model") and os.path.isfile(os.path.join(origin, name)):
            shutil.copyfile(os.path.join(origin, name), os.path.join(out, name))
    commit_directory(out, kind, metadata={"source_checkpoint": remote(path), "iteration": saved.get("iteration"),
                                          "weights": files, "origin_hf_dir": origin, "lora": saved, **extra})
    # "hf_dir" either way, as callers read it; "format" says which
    result = {"hf_dir": out, "manifest_hash": manifest_hash(out), "source_checkpoint": path,
              "format": "merged" if kind == "hf_model" else "peft"}
    if "warning" in extra.get("peft_base", {}):
        result["warning"] = extra["peft_base"]["warning"]
    return result



def policy_hf_dir(config: Config, source: str, export_uri: str) -> str:
    """An HF directory to serve for `source`: itself when it is one, else its export at `export_uri`.

    The export is made once: a committed export of the same checkpoint is reused, one of another
    checkpoint is refused (ConfigError) rather than overwritten. No committed checkpoint under `source`
    raises NotCommittedError naming it.
    """
    from slime.backends.megatron.checkpoint import resolve_checkpoint
    from slime.storage import is_committed, read_manifest
    from slime.storage.staging import is_remote, local_copy, newest_committed

    options = config.run.storage_options
    if is_remote(source):  # in the store: a checkpoint (or --save root), or an HF export served as it is
        checkpoint = newest_committed(source, options)
        if checkpoint is None:
            raise NotCommittedError(f"{source} holds no committed checkpoint (no iter_*/manifest.json)")
        if read_manifest(checkpoint, options).kind == "hf_model":
            return local_copy(config, checkpoint)
    elif is_hf_dir(source):
        return source
    else:
        checkpoint = resolve_checkpoint(source)
    if is_committed(export_uri, options):
        if read_manifest(export_uri, options).metadata.get("source_checkpoint") == checkpoint:
            return local_copy(config, export_uri)
        raise ConfigError(f"{export_uri} holds the export of another checkpoint than {checkpoint}; choose "
                          "another output name or run_id")
    export_config = config.model_copy(deep=True)
    export_config.checkpoint.load = checkpoint
    export_config.export.output_dir = export_uri
    export_config.export.origin_hf_dir = config.export.origin_hf_dir or config.checkpoint.hf_checkpoint
    export_config.export.merge = True  # engines serve full weights: a LoRA checkpoint is merged
    logger.info("exporting %s to %s for serving", checkpoint, export_uri)
    return local_copy(config, run_export(export_config)["hf_dir"])

if __name__ == "__main__":
    from slime.cli import main

    sys.exit(main(["export", *sys.argv[1:]]))
