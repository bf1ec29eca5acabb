"""Megatron-LM's launch flags that are not megatron-core config fields, and what this project does with each.

`NEGATED`: the `--no-X` flags whose option has another name; each sets a megatron-core config field to False.
`LAUNCH`: the other Megatron-LM flags slime's launch scripts pass (renamed fields, values this project always
builds with, model-shape flags checked against the HF checkpoint, flags without effect here, refused ones);
everything else outside megatron-core's config dataclasses stays an unknown option.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from slime.errors import ConfigError

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
        flag, field = _flag(name), NEGATED[name]
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


# --- Megatron-LM's other launch flags ---------------------------------------------------------------------------
# THUDM/slime's launch scripts (scripts/run-*.sh, scripts/models/*.sh at commit 624b824a) pass Megatron-LM flags
# that are neither megatron-core config fields nor `NEGATED`; older slime scripts pass a few more (--use-dist-ckpt,
# --log-interval, ...). Each one is decided below, read in NVIDIA/Megatron-LM megatron/training/arguments.py and
# argument_utils.py (core_transformer_config_from_args) at the commit above. Anything not here stays an unknown
# option (slime/config/passthrough.py), so a typo still fails.


@dataclass(frozen=True)
class LaunchFlag:
    """What this project does with one Megatron-LM launch flag.

    kind: `renamed` (its value goes to the megatron-core field `field`), `agrees` (this project always builds
    with `value`; any other value is refused), `checkpoint` (it shapes the model: accepted only when it equals
    `from_checkpoint(hf_config, transformer_config)`, checked by `bridge.make_bridge`), `no_effect` (accepted,
    `why` names what does that job here) or `refused` (`why` says what is not built).
    """

    kind: Literal["renamed", "agrees", "checkpoint", "no_effect", "refused"]
    why: str
    switch: bool = False  # takes no value or true/false
    field: str | None = None
    value: Any = None
    from_checkpoint: Callable[[Any, Any], Any] | None = None


def _rope(hf: Any) -> dict[str, Any]:
    """The HF config's rotary settings: transformers 5 keeps them in rope_parameters, older ones in rope_scaling."""
    return dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})


def _rope_scaling_llama3(hf: Any, _tf: Any) -> bool:
    """Megatron-LM's --use-rope-scaling is Llama-3.1's frequency scaling: HF's rope type llama3."""
    rope = _rope(hf)
    return (rope.get("rope_type") or rope.get("type")) == "llama3"


def _partial_rotary_factor(hf: Any, _tf: Any) -> float:
    """Megatron-LM's --rotary-percent is HF's partial_rotary_factor (a top-level field, or in rope_parameters)."""
    return float(getattr(hf, "partial_rotary_factor", None) or _rope(hf).get("partial_rotary_factor") or 1.0)


_NOT_SPEC = ("comes from a slime_plugins layer spec (--spec); models here are built by mbridge from the HF config, "
             "so it is not built here")
_NO_MLA = ("multi-latent attention (DeepSeek-V3, Kimi-K2, GLM-5) is not built here: the trained families are Qwen2, "
           "Qwen3, Llama, Qwen3-MoE and GLM-4.5 (docs/megatron.md)")

LAUNCH: dict[str, LaunchFlag] = {
    # renamed: Megatron-LM's flag name for a megatron-core field (argument_utils.core_transformer_config_from_args)
    "decoder_first_pipeline_num_layers": LaunchFlag(
        "renamed", "layers on the first pipeline stage", field="num_layers_in_first_pipeline_stage"),
    "decoder_last_pipeline_num_layers": LaunchFlag(
        "renamed", "layers on the last pipeline stage", field="num_layers_in_last_pipeline_stage"),
    "fp8_format": LaunchFlag(
        "renamed", "FP8 format of Transformer Engine's layers, e4m3 or hybrid (Megatron-LM's --fp8-format has "
        "dest fp8); make_bridge refuses it where Transformer Engine is absent (the local spec has no FP8)",
        field="fp8"),
    # agrees: Megatron-LM makes it a knob, this project always builds one way
    "accumulate_allreduce_grads_in_fp32": LaunchFlag(
        "agrees", "Megatron-LM's DDP grad_reduce_in_fp32; build_model's DDP always accumulates and reduces "
        "gradients in fp32 (grad_reduce_in_fp32=True)", switch=True, value=True),
    "no_check_for_nan_in_loss_and_grad": LaunchFlag(
        "agrees", "turns off Megatron-LM's NaN check of loss and gradients; the train step here runs no such check "
        "(DDP's check_for_nan_in_grad stays False)", switch=True, value=True),
    "no_position_embedding": LaunchFlag(
        "agrees", "no learned absolute position embedding; the models built here (mbridge's Qwen2/Qwen3/Llama/Qwen3-MoE/GLM-4.5 "
        "bridges) use rotary embeddings only", switch=True, value=True),
    # checkpoint: shapes the model, so it must equal what the HF checkpoint gives (bridge.make_bridge)
    "rotary_percent": LaunchFlag(
        "checkpoint", "fraction of each head's dimensions that rotary embeddings rotate: HF's partial_rotary_factor",
        from_checkpoint=_partial_rotary_factor),
    "use_rope_scaling": LaunchFlag(
        "checkpoint", "Llama-3.1 rotary frequency scaling: HF's rope type llama3 (rope_parameters / rope_scaling)", switch=True,
        from_checkpoint=_rope_scaling_llama3),
    "apply_layernorm_1p": LaunchFlag(
        "checkpoint", "zero-centred norm weights (1 + gamma): TransformerConfig.layernorm_zero_centered_gamma as "
        "mbridge builds it from the HF config", switch=True,
        from_checkpoint=lambda _hf, tf: bool(getattr(tf, "layernorm_zero_centered_gamma", False))),
    "num_experts": LaunchFlag(
        "checkpoint", "MoE experts per layer: TransformerConfig.num_moe_experts as mbridge builds it from the HF "
        "config (None for a dense model)", from_checkpoint=lambda _hf, tf: getattr(tf, "num_moe_experts", None)),
    # no effect: Megatron-LM's own training loop, data loader, logging or tokenizer, which this project does not use
    "use_dist_ckpt": LaunchFlag(
        "no_effect", "checkpoints here are always megatron-core dist_checkpointing (torch_dist), "
        "slime/backends/megatron/checkpoint.py", switch=True),
    "dist_ckpt_strictness": LaunchFlag(
        "no_effect", "checkpoint.py checks the manifest's architecture before loading (CheckpointMismatchError) and "
        "loads the model's whole sharded state dict; Megatron-LM's strictness knob is not read"),
    "use_mcore_models": LaunchFlag(
        "no_effect", "the model is always megatron-core's GPTModel, built by mbridge (Megatron-LM's legacy model is "
        "not here)", switch=True),
    "log_interval": LaunchFlag(
        "no_effect", "this project logs every step's metrics itself (RL: {store}/{run_id}/rl/metrics.jsonl and "
        "the trackers); Megatron-LM's training-loop log is not used"),
    "no_create_attention_mask_in_dataloader": LaunchFlag(
        "no_effect", "Megatron-LM's pretraining data loader is not used; the train step builds its causal and "
        "padding masks from the rollout rows", switch=True),
    "use_flash_attn": LaunchFlag(
        "no_effect", "the attention kernel follows the layer spec (Transformer Engine's, or torch SDPA in the local "
        "spec, which picks its flash kernel on CUDA) and --attention-backend", switch=True),
    "manual_gc": LaunchFlag(
        "no_effect", "Megatron-LM's training loop runs the manual GC; the train step here leaves Python's GC "
        "automatic", switch=True),
    "manual_gc_interval": LaunchFlag(
        "no_effect", "as --manual-gc: Megatron-LM's training loop is not used"),
    "tokenizer_type": LaunchFlag(
        "no_effect", "text is tokenized with the HF tokenizer of --hf-checkpoint (transformers); Megatron-LM's "
        "tokenizer is not built"),
    # refused: matters, and is not built here
    "spec": LaunchFlag("refused", "custom layer specs (slime_plugins' GLM-4, GLM-5, Qwen3-Next, ...) are not built "
                       "here: mbridge builds the layer spec from the HF config"),
    "enable_experimental": LaunchFlag(
        "refused", "megatron-core's experimental features are not enabled here (slime passes it for its GLM-5 "
        "plugin spec, --spec, which is not built here)"),
    "post_self_attn_layernorm": LaunchFlag("refused", f"GLM-4's post-attention norm {_NOT_SPEC}"),
    "post_mlp_layernorm": LaunchFlag("refused", f"GLM-4's post-MLP norm {_NOT_SPEC}"),
    "use_gated_attention": LaunchFlag("refused", f"Qwen3-Next / Qwen3.5 gated attention {_NOT_SPEC}"),
    **{name: LaunchFlag("refused", _NO_MLA) for name in (
        "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
        "rotary_scaling_factor", "mscale", "mscale_all_dim")},
}

# the launch flags that may stay in the `megatron` section (renamed ones are rewritten before validation)
LAUNCH_ACCEPTED: frozenset[str] = frozenset(name for name, f in LAUNCH.items() if f.kind in ("agrees", "checkpoint",
                                                                                     "no_effect"))


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def renamed_options(megatron: dict[str, Any]) -> dict[str, Any]:
    """`megatron` with each `renamed` launch flag replaced by its megatron-core field (same value); the flag and
    its field both given with different values is refused."""
    out = dict(megatron)
    for name, flag in LAUNCH.items():
        if flag.kind != "renamed" or name not in out:
            continue
        value = out.pop(name)
        if flag.field in out and out[flag.field] != value:
            raise ValueError(f"megatron.{name}: {_flag(name)} {value!r} is Megatron-LM's name for {flag.field}, "
                             f"which is also given as {out[flag.field]!r}; keep one of them")
        out[flag.field] = value
    return out


def launch_problems(megatron: dict[str, Any]) -> list[tuple[str, str]]:
    """(megatron.name, why) for each launch flag of `megatron` that is refused here or has a value it cannot take."""
    problems = []
    for name in sorted(set(megatron) & set(LAUNCH)):
        flag, value, where = LAUNCH[name], megatron[name], f"megatron.{name}"
        if flag.kind == "refused":
            problems.append((where, f"{_flag(name)} is refused: {flag.why}"))
        elif flag.switch and not isinstance(value, bool):
            problems.append((where, f"{_flag(name)} is a switch; give it no value or true/false, not {value!r}"))
        elif flag.kind == "agrees" and value != flag.value:
            problems.append((where, f"{_flag(name)}={value!r} is not built here: {flag.why}"))
        elif name == "rotary_percent" and (isinstance(value, bool) or not isinstance(value, int | float)
                                           or not 0 < value <= 1):
            problems.append((where, f"{_flag(name)} must be a number in (0, 1], got {value!r}"))
    return problems


def checkpoint_mismatches(megatron: dict[str, Any], hf_config: Any, transformer_config: Any) -> list[str]:
    """One message per `checkpoint` launch flag of `megatron` whose value differs from the checkpoint's."""
    out = []
    for name in sorted(set(megatron) & set(LAUNCH)):
        flag = LAUNCH[name]
        if flag.kind != "checkpoint":
            continue
        actual = flag.from_checkpoint(hf_config, transformer_config)
        if megatron[name] != actual:
            out.append(f"megatron.{name}: {_flag(name)} {megatron[name]!r}, but the checkpoint gives {actual!r} "
                       f"({flag.why})")
    return out


def no_effect_notes(megatron: dict[str, Any]) -> dict[str, str]:
    """flag -> why it has no effect here, for the launch flags of `megatron` that are accepted without effect."""
    return {_flag(name): LAUNCH[name].why for name in sorted(set(megatron) & set(LAUNCH))
            if LAUNCH[name].kind in ("no_effect", "agrees")}


def launch_flag_table_markdown() -> str:
    """The Megatron-LM launch-flag table of docs/configuration.md."""
    lines = [
        "## Megatron-LM launch flags",
        "",
        "Megatron-LM flags that slime's launch scripts pass and that are not megatron-core config fields "
        "(`slime/config/megatron_flags.py`). `renamed`: the value goes to the named megatron-core field; `agrees`: this "
        "project always builds that way, another value is refused; `checkpoint`: shapes the model, accepted only "
        "when it equals what the HF checkpoint gives (checked when the bridge is made); `no_effect`: accepted and "
        "logged, the note says what does the job here; `refused`: stops `load_config` with the reason. Any other "
        "flag that is not a megatron-core field is an unknown option.",
        "",
        "| flag | here | what / why |",
        "|---|---|---|",
    ]
    for name, flag in LAUNCH.items():
        why = f"{flag.field}: {flag.why}" if flag.kind == "renamed" else flag.why
        value = f" (only {flag.value!r})" if flag.kind == "agrees" else ""
        lines.append(f"| `{_flag(name)}` | {flag.kind}{value} | {why.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CUDA graphs (cuda_graphs.py)

SCOPES = ("full", "attn", "mlp")  # the local implementation graphs the whole dense layer for each


def requested(megatron: Mapping[str, Any]) -> bool:
    """Whether the megatron pass-through options ask for megatron-core's local CUDA graphs
    (`cuda_graph_impl: local`, or the deprecated `enable_cuda_graph: true` megatron maps onto it)."""
    return megatron.get("cuda_graph_impl") == "local" or bool(megatron.get("enable_cuda_graph"))


def _scopes(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [s.strip() for s in value.split(",") if s.strip()]
    if isinstance(value, list | tuple):
        return [str(s) for s in value]
    return [str(value)]


def option_problems(megatron: Mapping[str, Any], *, offload_train: bool,
                    dynamic_batch: bool) -> list[tuple[str, str]]:
    """(field, why) for each CUDA-graph option of `megatron` this trainer cannot run; empty when fine.
    `offload_train`: the train ranks offload between steps (colocated); `dynamic_batch`: the micro-batch
    shapes change from step to step (train.use_dynamic_batch_size)."""
    problems: list[tuple[str, str]] = []
    impl = megatron.get("cuda_graph_impl", "none")
    if impl not in ("none", "local", "transformer_engine"):
        problems.append(("megatron.cuda_graph_impl", f"{impl!r} is not one of none, local, transformer_engine"))
    if impl == "transformer_engine" or megatron.get("external_cuda_graph"):
        field = "megatron.cuda_graph_impl" if impl == "transformer_engine" else "megatron.external_cuda_graph"
        problems.append((field, "Transformer Engine's graphs (make_graphed_callables) are captured by Megatron-LM's "
                                "training loop, which this trainer does not run: use cuda_graph_impl=local, megatron-core's "
                                "own per-layer graphs (no Transformer Engine needed)"))
    if not requested(megatron):
        return problems
    unknown = [s for s in _scopes(megatron.get("cuda_graph_scope")) if s not in SCOPES]
    if unknown:
        why = ("captures the whole iteration from Megatron-LM's training loop, outside megatron-core's schedules"
               if unknown[0] == "full_iteration" else "applies to MoE or Mamba layers, which these dense models lack")
        problems.append(("megatron.cuda_graph_scope", f"{unknown[0]!r} {why}; leave cuda_graph_scope unset "
                                                      "(each transformer layer is one graph)"))
    if megatron.get("recompute_granularity") == "full" or megatron.get("recompute_method"):
        problems.append(("megatron.recompute_granularity", "full activation recomputation is only supported by "
                                                           "megatron with full-iteration graphs: use "
                                                           "recompute_granularity=selective or no graphs"))
    if offload_train:
        problems.append(("cluster.offload_train", "the colocated offload moves the weights and gradient buffers to "
                                                  "new GPU addresses, and the captured graphs keep the old ones: "
                                                  "run without colocate/offload_train to use cuda_graph_impl=local"))
    if dynamic_batch:
        problems.append(("train.use_dynamic_batch_size", "dynamic batching changes the micro-batch shapes every step, "
                                                         "and graphs replay only the first step's shapes: use a fixed "
                                                         "micro_batch_size with cuda_graph_impl=local"))
    return problems


def check_options(megatron: Mapping[str, Any], *, offload_train: bool = False, dynamic_batch: bool = False) -> None:
    """`option_problems` as a ConfigError (the first problem), for callers without a config tree."""
    problems = option_problems(megatron, offload_train=offload_train, dynamic_batch=dynamic_batch)
    if problems:
        field, why = problems[0]
        raise ConfigError(f"{field}: {why}")
