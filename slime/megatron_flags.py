"""Megatron-LM's `--no-X` flags whose option has another name: each sets a megatron-core config field to False.

Megatron-LM's parser (megatron/training/arguments.py) spells several switches as `store_false` flags with a
`dest` of another name (`--no-rope-fusion` -> `apply_rope_fusion=False`), and `--no-persist-layer-norm` as a
`store_true` flag that `core_transformer_config_from_args` (megatron/training/argument_utils.py) turns into
`persist_layer_norm=False`. slime command lines carry them verbatim, but the `megatron` pass-through section
holds megatron-core's own field names (what `bridge.model_options` hands to the `TransformerConfig`), so
`negated_options` rewrites each flag into its field set to False. The checkpoint-loading flags
(`--no-load-optim`, `--no-load-rng`, `--finetune`) are typed fields of the checkpoint section instead.

One departure: Megatron-LM reads `--no-bias-swiglu-fusion` for SwiGLU models and `--no-bias-gelu-fusion`
otherwise (both become `bias_activation_fusion`); here the model's activation comes from its HF config after
the flags are read, so either one turns the model's bias-activation fusion off.
"""

from __future__ import annotations

from typing import Any

# Megatron-LM flag (underscored) -> the model option (TransformerConfig field, `bridge.model_options`) it sets to
# False. Read in NVIDIA/Megatron-LM at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553: arguments.py
# (_add_training_args: the store_false flags and their dest) and argument_utils.py (core_transformer_config_
# from_args: persist_layer_norm = not no_persist_layer_norm; bias_activation_fusion = bias_swiglu_fusion with
# --swiglu, else bias_gelu_fusion). Only the model's fusions: Megatron-LM's other --no-X flags set options this
# project does not read (p2p overlap, DDP param gather, CPU-offload pinning) and stay unknown options.
NEGATED: dict[str, str] = {
    "no_gradient_accumulation_fusion": "gradient_accumulation_fusion",  # ModelParallelConfig
    "no_rope_fusion": "apply_rope_fusion",
    "no_masked_softmax_fusion": "masked_softmax_fusion",
    "no_bias_swiglu_fusion": "bias_activation_fusion",
    "no_bias_gelu_fusion": "bias_activation_fusion",
    "no_bias_dropout_fusion": "bias_dropout_fusion",
    "no_persist_layer_norm": "persist_layer_norm",
}


def negated_options(megatron: dict[str, Any]) -> dict[str, Any]:
    """`megatron` with each Megatron-LM `--no-X` flag of `NEGATED` replaced by its field set to False.

    The flag takes no value or a boolean: true (or no value) sets the field False, false leaves it unset.
    A flag together with its field set to true (`--no-rope-fusion --apply-rope-fusion true`) is refused.
    """
    out = {name: value for name, value in megatron.items() if name not in NEGATED}
    for name, value in megatron.items():
        if name not in NEGATED:
            continue
        flag, field = f"--{name.replace('_', '-')}", NEGATED[name]
        if not isinstance(value, bool):
            raise ValueError(f"megatron.{name}: {flag} is a switch (Megatron-LM sets {field}=False); give it no "
                             f"value or true/false, not {value!r}")
        if not value:
            continue
        if out.get(field, False) is not False:
            raise ValueError(f"megatron.{name}: {flag} sets {field}=False, but {field} is also given as "
                             f"{out[field]!r}; keep one of them")
        out[field] = False
    return out
