"""GLM-4.5 (HF `glm4_moe`) on megatron-core through mbridge: the config mbridge's bridge leaves out or gets wrong,
the checks of what megatron-core cannot express, and the MTP layers.

What GLM-4.5 is, against Qwen3-MoE: the first `first_k_dense_replace` layers are dense (megatron's `moe_layer_freq`,
`[0] * k + [1] * rest`); each MoE layer has `n_shared_experts` shared experts next to the routed ones (megatron's
`moe_shared_expert_intermediate_size` = moe_intermediate_size x n_shared_experts); the router scores with a sigmoid,
adds a per-expert bias (`mlp.gate.e_score_correction_bias`, megatron's `router.expert_bias` buffer) to pick the
top-k but not to weigh them, picks among the best `topk_group` of `n_group` expert groups first (a group's score:
the sum of its two best biased scores), renormalises the k weights and multiplies them by `routed_scaling_factor`
(megatron's `moe_router_num_groups` / `moe_router_group_topk`, `moe_router_score_function` "sigmoid",
`moe_router_enable_expert_bias`, `moe_router_topk_scaling_factor`); heads rotate only their first
`partial_rotary_factor` of dimensions (megatron's `rotary_percent`; transformers 5 keeps it in `rope_parameters`,
mbridge reads a top-level field); q/k RMS norms when `use_qk_norm`, q/k/v biases when `attention_bias`.

mbridge 0.15's glm4_moe bridge sets the shared experts' width to one expert's (wrong for n_shared_experts > 1),
q/k/v biases always, no expert groups, and asks for Transformer Engine's grouped GEMM and shared-expert overlap;
`bridge_args` gives megatron what the HF config says. megatron-core's group score sums the best
topk / group_topk scores of a group where HF sums the best two, and its sigmoid router always renormalises the
top-k weights: configs where these differ from HF are refused (`check_hf_config`); GLM-4.5 and 4.5-Air
(n_group 1, norm_topk_prob) are not among them.

The expert bias. megatron-core moves it after each step by `moe_router_bias_update_rate` x sign(mean load - the
expert's load) (aux-loss-free balancing, `finalize_model_grads`). slime's GLM-4.5 scripts pass
`--moe-router-enable-expert-bias --moe-router-bias-update-rate 0`: RL keeps the pretrained bias, so the policy's
routing changes only through the router weights it trains. That is the default here (`bridge_args` sets the rate to
0, explicitly, where megatron's default is 1e-3); `--moe-router-bias-update-rate R` > 0 turns the balancing on. Either
way the bias is in the checkpoint (a persistent buffer of the sharded state dict) and exported as
`e_score_correction_bias`.

MTP. GLM-4.5 checkpoints hold `num_nextn_predict_layers` multi-token-prediction layers as
`model.layers.{num_hidden_layers + i}.*` (enorm, hnorm, eh_proj, shared_head.norm and a whole decoder layer), which
SGLang uses as the speculative-decoding draft. As in slime without `--mtp-num-layers`, they are not built or trained
here: loading skips them (one log line, `log_skipped_mtp`) and the `export` stage copies them unchanged from the
origin HF checkpoint (`carried_mtp_weights`), so an exported checkpoint still serves with its draft layer, untrained.
Weight syncs to the rollout engines send the trained model's weights only; an engine keeps the draft it loaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from slime.errors import ConfigError

logger = logging.getLogger(__name__)

MODEL_TYPE = "glm4_moe"
# what slime's scripts (and this project, by default) do with the expert bias during RL: keep it
DEFAULT_BIAS_UPDATE_RATE = 0.0


def partial_rotary_factor(config: Any) -> float:
    """HF's partial_rotary_factor: a top-level field (transformers 4) or in rope_parameters (transformers 5)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    return float(getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1.0)


def check_hf_config(config: Any, hf_dir: str) -> None:
    """Refuse what megatron-core's router cannot compute as HF's `Glm4MoeTopkRouter` does; set the top-level
    `partial_rotary_factor` mbridge reads (as `load_hf_config` does for rope_theta)."""
    topk, groups, group_topk = config.num_experts_per_tok, config.n_group or 1, config.topk_group or 1
    experts = config.n_routed_experts
    if not config.norm_topk_prob and topk > 1:
        raise ConfigError(f"{hf_dir}: norm_topk_prob false is not supported for glm4_moe: megatron-core's sigmoid "
                          "router always renormalises the top-k weights (GLM-4.5 checkpoints ship true)")
    if groups > 1:
        if experts % groups:
            raise ConfigError(f"{hf_dir}: n_group {groups} does not divide n_routed_experts {experts}")
        if topk // group_topk != 2:
            raise ConfigError(f"{hf_dir}: n_group {groups} with num_experts_per_tok {topk} and topk_group {group_topk} "
                              "is not supported: HF scores a group by its two best experts, megatron-core by its best "
                              f"num_experts_per_tok // topk_group = {topk // group_topk}")
    if (config.n_shared_experts or 0) < 1:
        raise ConfigError(f"{hf_dir}: glm4_moe without shared experts (n_shared_experts "
                          f"{config.n_shared_experts}) is not supported: HF still builds a zero-width shared MLP")
    if config.first_k_dense_replace >= config.num_hidden_layers:
        raise ConfigError(f"{hf_dir}: first_k_dense_replace {config.first_k_dense_replace} leaves no MoE layer of "
                          f"the {config.num_hidden_layers}")
    config.partial_rotary_factor = partial_rotary_factor(config)


def moe_layer_freq(config: Any) -> list[int]:
    """megatron's moe_layer_freq of the HF config: the first `first_k_dense_replace` layers dense."""
    k = config.first_k_dense_replace
    return [0] * k + [1] * (config.num_hidden_layers - k)


def bridge_args(config: Any) -> dict[str, Any]:
    """The TransformerConfig fields of a glm4_moe model over mbridge's (see the module docstring)."""
    groups = config.n_group or 1
    return dict(
        moe_layer_freq=moe_layer_freq(config),
        moe_shared_expert_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
        moe_shared_expert_overlap=False,  # a CUDA-stream overlap with the alltoall dispatch; a speed knob
        add_qkv_bias=bool(config.attention_bias),
        qk_layernorm=bool(config.use_qk_norm),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=DEFAULT_BIAS_UPDATE_RATE,
        moe_router_topk_scaling_factor=float(config.routed_scaling_factor),
        # one group is no grouping: megatron's group-limited top-k would only pick that group
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=(config.topk_group or 1) if groups > 1 else None,
        # no effect with sigmoid scores (megatron renormalises the top-k); slime's GLM-4.5 scripts pass it
        moe_router_pre_softmax=True,
        # GLM-4.5's balance loss is sequence-wise (mbridge's choice); off unless a coefficient is given (moe_options)
        moe_router_load_balancing_type="none",
    )


def layer_pattern(value: Any, num_layers: int) -> list[int] | None:
    """megatron's `moe_layer_freq` as a per-layer list: an int N (every N-th layer MoE, from layer 0), a list, or
    Megatron-LM's command-line string (`[0]*3+[1]*89`, as slime's scripts write it). None when unreadable."""
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"\d+", text):
            value = int(text)
        elif re.fullmatch(r"[\[\]\d\s,*+()]+", text):  # list literals, repetition and concatenation only
            try:
                value = eval(text, {"__builtins__": {}}, {})  # noqa: S307 - the characters are checked above
            except Exception:
                return None
        else:
            return None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return [1 if i % value == 0 else 0 for i in range(num_layers)] if value > 0 else None
    if isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def mtp_layer_ids(config: Any) -> range:
    """The HF layer ids of the MTP layers a GLM-4.5 checkpoint holds (after the decoder's)."""
    n = config.num_hidden_layers
    return range(n, n + int(getattr(config, "num_nextn_predict_layers", 0) or 0))


def _mtp_prefixes(config: Any) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}." for i in mtp_layer_ids(config))


def _weight_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"] if os.path.isfile(os.path.join(hf_dir, "model.safetensors")) else []


def mtp_weight_names(hf_dir: str, config: Any) -> list[str]:
    """The MTP tensors' names in the HF checkpoint at `hf_dir` (none when it has no MTP layer)."""
    prefixes = _mtp_prefixes(config)
    if not prefixes:
        return []
    names = []
    for file in _weight_files(hf_dir):
        with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
            names += [k for k in f.keys() if k.startswith(prefixes)]  # noqa: SIM118 - safe_open has no __iter__
    return sorted(names)


def log_skipped_mtp(hf_dir: str, config: Any) -> None:
    """The one log line of a load that leaves the checkpoint's MTP layers out."""
    if getattr(config, "model_type", None) != MODEL_TYPE:
        return
    names = mtp_weight_names(hf_dir, config)
    if names:
        layers = list(mtp_layer_ids(config))
        logger.info("%s: %d MTP layer(s) (HF layers %s, %d tensors) not loaded: multi-token prediction is not trained "
                    "here; the export stage copies them unchanged from this checkpoint", hf_dir, len(layers),
                    layers, len(names))


def carried_mtp_weights(origin_hf_dir: str, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The MTP tensors of the origin HF checkpoint, unchanged, for an export (see the module docstring)."""
    prefixes = _mtp_prefixes(config)
    if not prefixes:
        return
    for file in _weight_files(origin_hf_dir):
        with safe_open(os.path.join(origin_hf_dir, file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name.startswith(prefixes):
                    yield name, f.get_tensor(name)
