"""LoRA adapters of a Megatron model as a PEFT adapter directory (`peft.PeftModel.from_pretrained(base, dir)`).

Megatron fuses q/k/v into `linear_qkv` and gate/up into `linear_fc1`, with one adapter each; PEFT has one
adapter per HF module. The fused adapter is exactly PEFT's adapters with A shared: for q, k and v,
lora_A = A and lora_B = the rows of B that hold q (k, v) in Megatron's layout. Those rows are found by
sending a row-index tensor through mbridge's own Megatron -> HF conversion of the weight, so B's rows
land where the weight's rows land, whatever the model's head grouping. Tensor-parallel shards are gathered
first with mbridge's merge of the weight (`bridge.gather_tensor_parallel`).

The directory is written with peft itself: `get_peft_model` on an HF model built on the meta device (so
only the adapter tensors take memory) names and shapes the adapter tensors, which must be exactly ours,
and its `save_pretrained(state_dict=...)` writes them with the adapter config.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from slime.backends.megatron import lora
from slime.backends.megatron.bridge import _local_to_global, gather_tensor_parallel
from slime.errors import ConfigError
from slime.storage.fs import is_hf_dir


@torch.no_grad()
def peft_state_dict(bridge: Any, models: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors (`base_model.model.<hf module>.lora_A.weight`, ...) of the whole model; a
    collective over the tensor-parallel group (every rank gets the full tensors)."""
    from mbridge.core.util import unwrap_model

    out: dict[str, torch.Tensor] = {}
    for model in unwrap_model(models):
        names = _local_to_global(bridge, model)
        for name, layer in lora.adapted_layers(model):
            weight_name = names[f"{name}.weight"]
            a = gather_tensor_parallel(bridge, weight_name, layer.lora_a).detach().cpu()
            b = gather_tensor_parallel(bridge, weight_name, layer.lora_b).detach().cpu()
            for hf_name, index in _hf_rows(bridge, weight_name, b.shape[0], a.shape[1]):
                module = "base_model.model." + hf_name.removesuffix(".weight")
                out[f"{module}.lora_A.weight"] = a.clone()
                out[f"{module}.lora_B.weight"] = b[index].clone()
    return out


_ROWS: dict[tuple[int, str, int, int], list[tuple[str, torch.Tensor]]] = {}


def _hf_rows(bridge: Any, weight_name: str, rows: int, cols: int) -> list[tuple[str, torch.Tensor]]:
    """(HF weight name, the Megatron rows it takes) for a [rows, cols] weight: a row-index tensor sent through
    mbridge's conversion, once per weight (a weight-sized tensor: adapter sync asks for it every sync)."""
    key = (id(bridge.hf_config), weight_name, rows, cols)
    if key not in _ROWS:
        index = torch.arange(rows, dtype=torch.float32).unsqueeze(1).expand(-1, cols).contiguous()
        names, converted = bridge._weight_to_hf_format(weight_name, index)
        _ROWS[key] = [(name, part[:, 0].long()) for name, part in zip(names, converted, strict=True)]
    return _ROWS[key]


def save_peft_adapter(bridge: Any, models: list[torch.nn.Module], out_dir: str, *, base_model: str) -> str | None:
    """Write the adapters of `models` as a PEFT LoRA directory at `out_dir` (rank 0 writes; a collective).
    `base_model` is the model the adapter applies to (recorded as base_model_name_or_path; `peft_base`)."""
    import torch.distributed as dist

    spec = lora.spec_of(models[0])
    if spec is None:
        raise ConfigError("PEFT export: the model has no LoRA adapters")
    state = peft_state_dict(bridge, models)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    write_peft_adapter(state, spec, out_dir, base_model=base_model, hf_config=bridge.hf_config)
    return out_dir


def peft_base(source: str) -> dict[str, Any]:
    """The model a PEFT user applies adapters trained on the LoRA base `source` to (what `--merge false`
    records as `base_model_name_or_path`): `source` itself when it is an HF directory; the HF directory a
    conversion (`slime convert`, the pipeline's LoRA base) was made from, which holds its weights; else
    `source`, a trained Megatron checkpoint (e.g. a full SFT) that transformers cannot load, with a
    `warning` saying so and how to get its HF weights. (Naming the origin HF directory there would give
    the user a model the adapters were not trained on, silently.)"""
    from slime.storage import read_manifest

    if is_hf_dir(source):
        return {"base_model_name_or_path": source, "lora_base": source, "hf_loadable": True}
    meta = read_manifest(source).metadata
    if meta.get("stage") == "convert" and meta.get("origin_hf_dir"):
        return {"base_model_name_or_path": meta["origin_hf_dir"], "lora_base": source, "hf_loadable": True}
    return {"base_model_name_or_path": source, "lora_base": source, "hf_loadable": False,
            "warning": f"the adapters were trained on the Megatron checkpoint {source} (stage {meta.get('stage')!r}), "
                       "not on an HF model: base_model_name_or_path names that checkpoint, which transformers "
                       f"cannot load; export it (`slime export --load {source} --output-dir DIR`) and apply the "
                       "adapter to DIR with peft.PeftModel.from_pretrained, or export merged weights (--merge true)"}


_PEFT_MODELS: dict[tuple, tuple[Any, dict[str, torch.Tensor]]] = {}


def write_peft_adapter(state: dict[str, torch.Tensor], spec: lora.LoraSpec, out_dir: str, *, base_model: str,
                       hf_config: Any) -> None:
    """`state` (PEFT key names) saved by peft as the adapter of `spec` (r, lora_alpha, lora_dropout)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    modules = tuple(sorted({key.split(".")[-3] for key in state}))
    key = (spec.rank, spec.alpha, spec.dropout, modules, base_model, id(hf_config))
    if key not in _PEFT_MODELS:  # adapter sync writes every sync: build peft's meta model once (~50 ms)
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=list(modules),
                            task_type="CAUSAL_LM", base_model_name_or_path=base_model, bias="none")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        peft_model = get_peft_model(model, config)
        # get_peft_model replaces the name with the model's own (the HF config's directory): keep the real base
        peft_model.peft_config["default"].base_model_name_or_path = base_model
        _PEFT_MODELS.clear()  # one model kept: one adapter layout per process
        _PEFT_MODELS[key] = (peft_model, get_peft_model_state_dict(peft_model))
    peft_model, expected = _PEFT_MODELS[key]  # expected: the names and shapes peft gives this adapter
    wrong = sorted(set(expected) ^ set(state)) or [k for k in state if expected[k].shape != state[k].shape]
    if wrong:
        raise ConfigError(f"PEFT export: adapter tensors differ from peft's for this model: {wrong[:3]}")
    os.makedirs(out_dir, exist_ok=True)
    peft_model.save_pretrained(out_dir, state_dict=state)
