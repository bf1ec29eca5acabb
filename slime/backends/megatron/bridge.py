"""HF <-> Megatron-core model bridging through mbridge, with the fixes mbridge 0.15 needs here.

mbridge maps Hugging Face checkpoints onto megatron-core `GPTModel`s and back. Four things stop it
working with transformers 5 and without Transformer Engine (both the CPU machines and the GPU
machine here lack TE); `make_bridge` fixes each on the bridge instance, never on mbridge's classes:

1. transformers 5 keeps `rope_theta` in `config.rope_parameters`; mbridge reads `config.rope_theta`.
2. mbridge always builds the Transformer Engine layer spec; without TE we use megatron-core's local
   spec (`use_transformer_engine=False`).
3. The local spec has separate norm weights (`input_layernorm`, `pre_mlp_layernorm`) that mbridge's
   name maps do not know; they are added (the MLP map is chosen by "mlp" in the name).
4. The fused kernels that need apex or TE are switched off. megatron's fused SwiGLU
   (`bias_activation_fusion`, `megatron.core.fusions.fused_bias_swiglu`, bias or not) needs neither: it
   is `torch.compile`d (`megatron.core.jit.jit_fuser`), so it is on where torch.compile makes GPU kernels
   (CUDA with Triton, `fused_activation_available`) and off on CPU, where it would only add an inductor
   C++ compile to the first step; without a bias it runs `swiglu_kernel.py`'s Triton kernel instead (the
   same values at a fraction of a compiled call's host cost). Two more get torch providers in TE's and
   Apex's place, on by default under the same condition and turned on or off by their megatron options:
   rotary fusion (`apply_rope_fusion`, `rope_fusion.py`: a Triton kernel, or a torch.compile'd rotation
   where it does not apply) and gradient-accumulation fusion
   (`gradient_accumulation_fusion`, `wgrad_fusion.py`: the weight-gradient GEMM writes into the fp32
   `main_grad`; CUDA with torch's bf16 -> fp32 GEMM). Models built without DDP have no `main_grad`:
   `build_model` computes their weight gradients unfused.
5. LoRA adapters (`lora.py`) are parameters mbridge has no HF name for: its local -> global name map
   leaves them out, so loading HF weights fills the base and never touches an adapter.
6. megatron's frozen-weight linear (every base weight under LoRA, what a freeze list freezes) ran a
   non-contiguous gradient as one small GEMM per sequence position (`frozen_linear.py`): `make_bridge`
   installs a wrapper that hands it contiguous tensors.
7. megatron's linear layers pay per call for an autocast context and a deprecation warning that change
   nothing here (`host_trims.py`): `make_bridge` skips them (same kernels, same bits).

mbridge also writes the tied-embedding mapping into its *class* dict at construction, so a process
that bridges a tied and then an untied model would map the output layer wrongly; each bridge gets
its own copy of the maps. Research notes: ../shared/research/megatron.md.

Mixture-of-experts (Qwen3-MoE, `qwen3_moe`): mbridge's bridge asks for grouped-GEMM experts, which are
Transformer Engine's (or the `grouped_gemm` package's); without TE the experts are megatron-core's
`SequentialMLP` (`moe_grouped_gemm=False`), whose parameters are `mlp.experts.local_experts.{i}.linear_fc1
.weight`, where mbridge's maps know TE's `mlp.experts.linear_fc1.weight{i}`. `_moe_names` renames the one
into the other in the local -> global name map (expert ids made global under expert parallelism, as mbridge
does for TE's names), so mbridge's loading, export and tensor-parallel splits apply unchanged. mbridge's
Qwen3-MoE router always renormalises the top-k weights (`moe_router_pre_softmax=False`); it is set from the
HF config's `norm_topk_prob` instead. The load-balancing loss follows the megatron options (`moe_options`).
megatron-core 0.16.1's router GEMM (`moe_utils.RouterGatingLinearFunction`) tests `te_general_gemm is not None`,
a name its module defines only when Transformer Engine imports (NameError otherwise): `make_bridge` defines it
as None, megatron's own "no TE" value, which selects its torch.mm path. With `routing_replay` every router gets
megatron's `RouterReplay` (`moe_enable_routing_replay`), which routing_replay.py drives (slime's R2/R3).

GLM-4.5 (`glm4_moe`): a dense first layer, shared experts, grouped sigmoid routing with an expert bias, partial
rotary; glm4_moe.py sets these on megatron-core over mbridge's bridge (which got several wrong), checks what
megatron-core's router cannot compute as HF's, and says what happens to the expert bias and the MTP layers. mbridge's
glm4_moe name map knows neither the maps fixed above nor the local spec's norms: the generic one is used instead.
Options a command line gives for the routing (`ARCHITECTURE_FIELDS`) must mean what the checkpoint's do
(`_same_option`: slime's `--moe-layer-freq [0]*3+[1]*89` is the per-layer list).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.util
import inspect
import logging
import re
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig

from slime.compiled import triton_on_cuda
from slime.config.megatron_flags import checkpoint_mismatches
from slime.errors import ConfigError
from slime.net import find_free_port

logger = logging.getLogger(__name__)

with warnings.catch_warnings():  # megatron warns at import when Transformer Engine / apex are absent
    warnings.simplefilter("ignore")
    from mbridge import AutoBridge
    from mbridge.core.bridge import Bridge
    from mbridge.core.util import unwrap_model
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils

    from slime.backends.megatron import (
        cuda_graphs,
        frozen_linear,
        glm4_moe,
        host_trims,
        rope_fusion,
        swiglu_kernel,
        wgrad_fusion,
    )
    from slime.backends.megatron.attention import with_sdpa
    from slime.backends.megatron.lora import has_adapters, is_adapter_name, named_export_tensors

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe")
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", *MOE_MODEL_TYPES)
# model types mbridge has a bridge for that are not built here yet, and why
NOT_YET_SUPPORTED = {
    "deepseek_v3": "multi-latent attention (MLA) needs megatron-core's MLA layer spec, which mbridge builds only with "
                   "Transformer Engine, and its MTP layers are not trained here",
}
# a SequentialMLP expert's parameter: layer prefix, local expert id, linear_fc1|linear_fc2
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
# mbridge's local -> global parameter names of each (unwrapped) model chunk, see `_local_to_global`
_LOCAL_TO_GLOBAL: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def init_megatron(seed: int, tensor_parallel: int = 1, pipeline_parallel: int = 1, *, rank: int = 0,
                  world_size: int = 1, init_method: str | None = None, timeout_minutes: float = 10,
                  megatron: dict[str, Any] | None = None, expert_parallel: int = 1,
                  expert_tensor_parallel: int | None = None) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU) and Megatron's parallel state for this rank.

    A single process (conversion, one-rank training) needs no arguments beyond the seed; data-parallel
    ranks pass their `rank`, the `world_size` and a shared `init_method` (`tcp://127.0.0.1:PORT`).
    On CPU the compatibility layer is activated first. `megatron` is the run's megatron pass-through
    section (the options `make_bridge` gets): when it asks for CUDA graphs (`cuda_graphs.requested`) the
    CUDA RNG tracker is the graph-safe one megatron's graph managers require; the tracker is made anew
    on every call, so one process can seed a run with graphs after one without. `expert_parallel` and
    `expert_tensor_parallel` (None: the tensor-parallel size) split each MoE layer's experts (see
    `expert_parallel_sizes`), as the parallel sizes do, only where given: conversion runs on one rank.
    """
    graphs = cuda_graphs.requested(megatron or {})
    if graphs:
        cuda_graphs.check_options(megatron)
        cuda_graphs.check_device(megatron)
    if not torch.cuda.is_available():
        from slime.backends.megatron import cpu_compat

        cpu_compat.activate()
    elif world_size > 1:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if world_size > 1 and init_method is None:
        raise ConfigError("init_megatron: a world of several ranks needs a shared init_method (tcp://host:port)")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=init_method or f"tcp://127.0.0.1:{find_free_port()}",
                                rank=rank, world_size=world_size, timeout=dt.timedelta(minutes=timeout_minutes))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel,
                                                 expert_model_parallel_size=expert_parallel,
                                                 expert_tensor_parallel_size=expert_tensor_parallel)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graphs, force_reset_rng=True)


def model_parallel_sizes(megatron: dict[str, Any], world_size: int,
                         world: str = "cluster.actor_num_nodes x actor_num_gpus_per_node") -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes from the `megatron:` pass-through options
    (--tensor-model-parallel-size, --pipeline-model-parallel-size), checked against the train world:
    data parallelism takes what is left, so TP x PP must divide it."""
    tp = int(megatron.get("tensor_model_parallel_size") or 1)
    pp = int(megatron.get("pipeline_model_parallel_size") or 1)
    if tp < 1 or pp < 1:
        raise ConfigError(f"megatron.tensor_model_parallel_size ({tp}) and pipeline_model_parallel_size ({pp}) "
                          "must be >= 1")
    if world_size % (tp * pp):
        raise ConfigError(f"{world_size} train ranks cannot be split into tensor_model_parallel_size {tp} x "
                          f"pipeline_model_parallel_size {pp} groups: TP x PP must divide the number of train "
                          f"ranks ({world})")
    expert_parallel_sizes(megatron, world_size, tp, pp)
    return tp, pp


def expert_parallel_sizes(megatron: dict[str, Any], world_size: int, tensor_parallel: int = 1,
                          pipeline_parallel: int = 1) -> tuple[int, int]:
    """(expert, expert-tensor) parallel sizes from the `megatron:` pass-through options
    (--expert-model-parallel-size, --expert-tensor-parallel-size; the latter defaults to the tensor-parallel
    size, as in megatron). The experts of a layer are split over EP ranks, each expert's weights over ETP
    ranks; EP x ETP x PP must divide the world (megatron's expert-data-parallel groups take the rest)."""
    ep = int(megatron.get("expert_model_parallel_size") or 1)
    etp = int(megatron.get("expert_tensor_parallel_size") or tensor_parallel)
    if ep < 1 or etp < 1:
        raise ConfigError(f"megatron.expert_model_parallel_size ({ep}) and expert_tensor_parallel_size ({etp}) must "
                          "be >= 1")
    if world_size % (ep * etp * pipeline_parallel):
        raise ConfigError(f"{world_size} train ranks cannot be split into expert_model_parallel_size {ep} x "
                          f"expert_tensor_parallel_size {etp} x pipeline_model_parallel_size {pipeline_parallel} "
                          "groups: their product must divide the number of train ranks")
    return ep, etp


def close_megatron() -> None:
    """Leave the process group together: a barrier, then Megatron's and torch's groups destroyed.

    Rank 0 hosts the rendezvous store; a rank that exits while another still tears down its gloo
    threads makes that one abort ("terminate called without an active exception"). Idempotent.
    """
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _local_layer_spec(self: Any, vp_stage: int | None = None) -> Any:
    """megatron-core's local (non-TE) decoder block spec, in place of mbridge's TE spec, with the
    fused SDPA core attention (`slime.backends.megatron.attention`) instead of the unfused one."""
    block = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    return dataclasses.replace(block, layer_specs=[with_sdpa(spec) for spec in block.layer_specs])


def load_hf_config(hf_dir: str) -> Any:
    config = AutoConfig.from_pretrained(hf_dir)
    if config.model_type in NOT_YET_SUPPORTED:
        raise ConfigError(f"{hf_dir}: model type {config.model_type!r} is not supported yet: "
                          f"{NOT_YET_SUPPORTED[config.model_type]}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{hf_dir}: model type {config.model_type!r} is not supported by the Megatron backend; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(config, "rope_theta", None) is None:  # fix 1
        config.rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    if config.model_type == "qwen3_moe" and (getattr(config, "mlp_only_layers", None)
                                             or getattr(config, "decoder_sparse_step", 1) != 1):
        raise ConfigError(f"{hf_dir}: dense layers among the MoE ones (mlp_only_layers "
                          f"{config.mlp_only_layers}, decoder_sparse_step {config.decoder_sparse_step}) are not supported "
                          "yet: mbridge's qwen3_moe bridge builds every layer as MoE (Qwen3-MoE checkpoints ship none)")
    if config.model_type == glm4_moe.MODEL_TYPE:
        glm4_moe.check_hf_config(config, hf_dir)
    return config


# the TransformerConfig fields that decide the shapes and meaning of the weights: the HF checkpoint sets them
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "kv_channels", "normalization", "gated_linear_unit", "add_qkv_bias", "add_bias_linear",
                       "qk_layernorm", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
                       "moe_router_pre_softmax", "moe_shared_expert_intermediate_size", "moe_layer_freq",
                       "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
                       "moe_router_num_groups", "moe_router_group_topk")


def _same_option(name: str, given: Any, actual: Any, num_layers: int) -> bool:
    """Whether a megatron option given on the command line means what the checkpoint's value means."""
    if name == "moe_layer_freq":
        return glm4_moe.layer_pattern(given, num_layers) == glm4_moe.layer_pattern(actual, num_layers)
    if name in ("moe_router_num_groups", "moe_router_group_topk") and actual is None:
        return given in (None, 1)  # one group of all experts is no grouping
    if name == "moe_router_topk_scaling_factor":
        return (given or 1.0) == (actual or 1.0)  # None: no scaling
    return given == actual


def model_options(megatron: dict[str, Any]) -> dict[str, Any]:
    """The Megatron pass-through options (`Config.megatron`) that configure the model: fields of megatron-core's
    `TransformerConfig` itself (recompute, dropout, fusions, ...), and `gradient_accumulation_fusion`, the one
    fusion of its `ModelParallelConfig` base. That base's other fields (parallel sizes, dtype) are set by
    `init_megatron` and the bridge; the rest (optimizer, scheduler) are not the model's."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer import TransformerConfig

    own = {f.name for f in dataclasses.fields(TransformerConfig)} - {f.name for f in dataclasses.fields(ModelParallelConfig)}
    return {name: value for name, value in megatron.items() if name in own | {"gradient_accumulation_fusion"}}


def make_bridge(hf_dir: str, dtype: torch.dtype = torch.float32, make_vocab_size_divisible_by: int | None = 128,
                megatron: dict[str, Any] | None = None, *, routing_replay: bool = False) -> Any:
    """An mbridge bridge for the HF checkpoint at `hf_dir`, fixed as the module docstring says.

    The model options of `megatron` (the config's megatron section, `model_options`) go into the model's
    TransformerConfig, over this module's fusion defaults; an architecture field there must equal what the
    checkpoint gives (slime command lines repeat the model's shape flags), else it is refused. Megatron's
    parallel state must be initialised first (`init_megatron`). `routing_replay` (slime's R2/R3) gives every MoE
    router megatron's `RouterReplay` (`moe_enable_routing_replay`, driven by `routing_replay.py`); refused for a
    model without experts and with CUDA graphs (a captured router would not read the replayed ids).
    """
    config = load_hf_config(hf_dir)
    if routing_replay and config.model_type not in MOE_MODEL_TYPES:
        raise ConfigError(f"routing replay (use_routing_replay / use_rollout_routing_replay) replays the experts of "
                          f"MoE routers, and {hf_dir} ({config.model_type}) has no experts: drop the flag")
    if routing_replay and cuda_graphs.requested(megatron or {}):
        raise ConfigError("routing replay sets each router's expert ids from Python before every micro-batch, which "
                          "megatron's CUDA graphs (megatron.cuda_graph_impl=local) would not see: use one or the other")
    bridge = AutoBridge.from_config(config, dtype=dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    moe = config.model_type in MOE_MODEL_TYPES
    if moe and not hasattr(moe_utils, "te_general_gemm"):  # see the module docstring
        moe_utils.te_general_gemm = None
    if moe:  # before the architecture checks below, which compare with the bridge's config
        routing = (glm4_moe.bridge_args(config) if config.model_type == glm4_moe.MODEL_TYPE
                   else {"moe_router_pre_softmax": not config.norm_topk_prob})
        bridge.set_extra_args(moe_grouped_gemm=False, **routing)
    cls = type(bridge)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    bridge._DIRECT_MAPPING = {**cls._DIRECT_MAPPING,
                              "output_layer.weight": "model.embed_tokens.weight" if tied else "lm_head.weight"}
    bridge._get_hf_shared_weight_keys = lambda: ["model.embed_tokens.weight"] if tied else []
    if config.model_type == glm4_moe.MODEL_TYPE:  # mbridge's own knows neither the maps above nor the local norms
        bridge._weight_name_mapping_mcore_to_hf = types.MethodType(Bridge._weight_name_mapping_mcore_to_hf, bridge)
    if not HAVE_TE:
        bridge._get_transformer_layer_spec = types.MethodType(_local_layer_spec, bridge)  # fix 2
        bridge._OTHER_MAPPING = {**cls._OTHER_MAPPING,  # fix 3
                                 "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
        bridge._MLP_MAPPING = {**cls._MLP_MAPPING,
                               "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]}
    options = model_options(megatron or {})
    if moe:
        _check_experts(bridge, options)
    if options.get("fp8") and not HAVE_TE:  # megatron-core's FP8 runs only in Transformer Engine's layers
        raise ConfigError(f"megatron.fp8={options['fp8']!r} (--fp8-format, --fp8): FP8 training runs in Transformer Engine's "
                          "layers, and there is no Transformer Engine here: the model is built on megatron-core's "
                          "local spec, in bf16/fp32, so FP8 is not built here; drop the flag")
    _check_graph_rng(options)
    defaults = dict(masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,  # fix 4
                    bias_activation_fusion=fused_activation_available(),
                    apply_rope_fusion=fused_activation_available() and not options.get("rotary_interleaved"),
                    gradient_accumulation_fusion=wgrad_fusion.available())
    if not torch.cuda.is_available():
        defaults["use_cpu_initialization"] = True
    # mbridge turns sequence parallelism on for TP > 1; the local spec's torch norms refuse it, and the
    # train step's log-probs read full-sequence outputs
    defaults["sequence_parallel"] = False
    for problem in checkpoint_mismatches(megatron or {}, config, bridge.config):  # --rotary-percent & co.
        raise ConfigError(f"{problem}, in the checkpoint {hf_dir}: the model's shape comes from its HF config; drop "
                          "the flag or fix it")
    if bridge.config.moe_router_score_function == "sigmoid":  # no effect on sigmoid scores (megatron renormalises
        options.pop("moe_router_pre_softmax", None)         # the top-k); slime's GLM-4.5 scripts pass it
    for name in sorted(set(options) & set(ARCHITECTURE_FIELDS)):
        given, actual = options.pop(name), getattr(bridge.config, name, None)
        if not _same_option(name, given, actual, bridge.config.num_layers):
            raise ConfigError(f"megatron.{name}={given!r}, but the checkpoint {hf_dir} gives {actual!r}: the model's "
                              "shape comes from its HF config; drop the flag or fix it")
    if moe:
        defaults.update(moe_options(options, "seq_aux_loss" if config.model_type == glm4_moe.MODEL_TYPE else "aux_loss"))
    chosen = {**defaults, **options}  # the config's options over the fusion defaults
    if routing_replay:
        chosen["moe_enable_routing_replay"] = True
    wgrad_fusion.check_options(chosen)
    if chosen["apply_rope_fusion"] and not rope_fusion.install():
        logger.info("apply_rope_fusion: Transformer Engine's rotary kernel")
    if chosen["gradient_accumulation_fusion"] and not wgrad_fusion.install():
        logger.info("gradient_accumulation_fusion: Apex's fused_weight_gradient_mlp_cuda")
    frozen_linear.install()
    host_trims.install()
    swiglu_kernel.install()  # only where megatron calls its fused SwiGLU (bias_activation_fusion), and on CUDA
    bridge.set_extra_args(**chosen)
    name_map = bridge._weight_name_mapping_mcore_local_to_global  # fix 5
    bridge._weight_name_mapping_mcore_local_to_global = lambda model, consider_ep=True: {
        k: _moe_names(bridge, v, consider_ep) for k, v in name_map(model, consider_ep=consider_ep).items()
        if not is_adapter_name(k)}
    return bridge


def moe_options(options: dict[str, Any], balancing_type: str = "aux_loss") -> dict[str, Any]:
    """The MoE defaults over mbridge's, given the model options of the config (`model_options`).

    The router scores in fp32 (`moe_router_dtype`, as HF's router and slime's Qwen3-MoE scripts do). The
    auxiliary load-balancing loss is off unless `moe_aux_loss_coeff` > 0: mbridge sets the coefficient from
    the HF config's `router_aux_loss_coef` but switches the loss off (`moe_router_load_balancing_type`
    "none", for RL), so a coefficient given here selects `balancing_type` unless a type is given (megatron's
    default `aux_loss`; GLM-4.5: `seq_aux_loss`, as slime's scripts name it); a coefficient with type "none" would
    do nothing and is refused. The router z-loss (`moe_z_loss_coeff`)
    needs no type. No token is dropped (`moe_expert_capacity_factor` None, mbridge's)."""
    coeff = options.get("moe_aux_loss_coeff", 0.0)
    coeffs = coeff if isinstance(coeff, list | tuple) else [coeff]
    balancing = options.get("moe_router_load_balancing_type")
    out: dict[str, Any] = {"moe_router_dtype": "fp32", "moe_aux_loss_coeff": 0.0}
    if any(c > 0 for c in coeffs):
        if balancing == "none":
            raise ConfigError(f"megatron.moe_aux_loss_coeff={coeff!r} with moe_router_load_balancing_type 'none': the "
                              "load-balancing loss would not be computed; drop one of them")
        if balancing is None:
            out["moe_router_load_balancing_type"] = balancing_type
    return out


def _check_experts(bridge: Any, options: dict[str, Any]) -> None:
    """Refuse MoE options this build cannot honour, naming why (before megatron's assertions would)."""
    if options.get("moe_grouped_gemm") and not HAVE_TE:
        raise ConfigError("megatron.moe_grouped_gemm: grouped-GEMM experts are Transformer Engine's (or the grouped_gemm "
                          "package's), absent here; the experts run as megatron-core's SequentialMLP")
    experts, ep = bridge.config.num_moe_experts, bridge.mpu.ep_size
    if experts % ep:
        raise ConfigError(f"megatron.expert_model_parallel_size {ep} does not divide the model's {experts} experts")


def _moe_names(bridge: Any, name: str, consider_ep: bool) -> str:
    """A global Megatron name as mbridge's maps know it: a SequentialMLP expert's
    `...mlp.experts.local_experts.{i}.linear_fcN.weight` -> TE's `...mlp.experts.linear_fcN.weight{e}`, with `e` the
    global expert id under expert parallelism when `consider_ep` (mbridge's own convention: its export
    renumbers local ids itself, so it asks without)."""
    match = _LOCAL_EXPERT.match(name)
    if match is None:
        return name
    prefix, local, linear = match.groups()
    expert = int(local)
    if consider_ep and bridge.mpu.ep_size > 1:
        expert += bridge.config.num_moe_experts // bridge.mpu.ep_size * bridge.mpu.ep_rank
    return f"{prefix}.{linear}.weight{expert}"


def _check_graph_rng(options: dict[str, Any]) -> None:
    """Model options asking for CUDA graphs need CUDA and the graph-safe RNG tracker, which `init_megatron`
    seeds when it is given the same megatron options; say so instead of megatron's bare assertion."""
    cuda_graphs.check_options(options)  # also refuses Transformer Engine's graphs, which are never "requested"
    if not cuda_graphs.requested(options):
        return
    cuda_graphs.check_device(options)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, is_graph_safe_cuda_rng_tracker

    if not is_graph_safe_cuda_rng_tracker(get_cuda_rng_tracker()):
        raise ConfigError("megatron.cuda_graph_impl=local needs megatron's graph-safe CUDA RNG tracker: pass the same "
                          "megatron options to init_megatron(..., megatron=...) before make_bridge")


def fused_activation_available() -> bool:
    """Whether megatron's torch.compile'd fusions (SwiGLU, and the rotary provider of `rope_fusion`) run as fused
    GPU kernels here: CUDA, and Triton for inductor to generate them with."""
    return triton_on_cuda()


def checkpoint_metadata(bridge: Any, hf_dir: str) -> dict[str, Any]:
    """What a checkpoint records so that export and training can rebuild the same model."""
    return {"model_type": bridge.hf_config.model_type, "hf_config": bridge.hf_config.to_dict(),
            "dtype": str(bridge.dtype).removeprefix("torch."), "origin_hf_dir": hf_dir,
            "padded_vocab_size": bridge.padded_vocab_size}


def build_model(bridge: Any, hf_dir: str | None = None, wrap_with_ddp: bool = False,
                use_distributed_optimizer: bool = False,
                post_create: Callable[..., None] | None = None) -> list[torch.nn.Module]:
    """The Megatron model chunks for `bridge`, loaded from the HF weights at `hf_dir` when given.
    With `wrap_with_ddp` they are wrapped in megatron DDP (gradient buffers), as training needs;
    `use_distributed_optimizer` lays the buffers out for the DistributedOptimizer (DP > 1);
    `post_create(model, **kw)` runs on each chunk before wrapping (e.g. `freeze.freeze_callback`)."""
    dtype = bridge.dtype
    ddp_config = ({"grad_reduce_in_fp32": True, "use_distributed_optimizer": use_distributed_optimizer}
                  if wrap_with_ddp else None)
    # Every model of a bridge shares its TransformerConfig, and the optimizer of the first one sets callbacks on it
    # (`grad_scale_func`: the optimizer's bound `scale_loss`, which holds process groups). megatron's MoE
    # `SequentialMLP` deep-copies the config, which cannot copy those: a second model of the bridge (the RL
    # reference, the OPD teacher) is built with the bound methods set aside, then they are put back.
    config = bridge.config
    held = {f.name: value for f in dataclasses.fields(config) if inspect.ismethod(value := getattr(config, f.name))}
    for name in held:
        setattr(config, name, None)
    try:
        models = bridge.get_model(wrap_with_ddp=wrap_with_ddp, bf16=dtype is torch.bfloat16,
                                  fp16=dtype is torch.float16, use_cpu_initialization=not torch.cuda.is_available(),
                                  ddp_config=ddp_config, post_model_creation_callbacks=[post_create] if post_create else [])
    finally:
        for name, value in held.items():
            setattr(config, name, value)
    if not wrap_with_ddp:  # no DDP, no main_grad to accumulate into: weight gradients the unfused way
        for model in models:
            for module in model.modules():
                if getattr(module, "gradient_accumulation_fusion", False):
                    module.gradient_accumulation_fusion = False
    if cuda_graphs.enabled(models):  # after post_create, which freezes what LoRA / freeze lists freeze
        cuda_graphs.prepare(models)
    if hf_dir is not None:
        glm4_moe.log_skipped_mtp(hf_dir, bridge.hf_config)  # mbridge reads only the names the model has
        bridge.load_weights(models, hf_dir)
    return models


def uses_local_export(bridge: Any) -> bool:
    """Whether `export_hf_weights` can skip mbridge's pipeline-group exchange: one pipeline stage,
    no expert parallelism and a dense model, so every weight is already on this rank (up to its
    tensor-parallel shards) and mbridge's per-tensor name and spec collectives move nothing."""
    mpu = bridge.mpu
    return mpu.pp_size == 1 and mpu.ep_size == 1 and not getattr(bridge.config, "num_moe_experts", None)


def export_hf_weights(bridge: Any, models: list[torch.nn.Module]) -> Any:
    """Iterator of (HF name, tensor) for the current Megatron weights, padded vocab rows removed.

    Same names, order and values as mbridge's `export_weights` (with pipeline parallelism it gathers
    every stage's weights on every rank, `_export_stages`); without pipeline or expert parallelism it
    goes through `_export_local`, which drops mbridge's per-tensor object
    collectives (docs/sync.md, "Export"). A model with LoRA adapters exports merged weights
    (base + scale * B @ A, `lora.merged_weight`) and no adapter tensor.
    """
    vocab = bridge.hf_config.vocab_size
    if not uses_local_export(bridge) and any(has_adapters(m) for m in models):
        raise ConfigError("LoRA weight export needs one pipeline stage and a dense model (no expert parallelism)")
    weights = _export_local(bridge, models) if uses_local_export(bridge) else _export_stages(bridge, models)
    for name, tensor in weights:
        if name in ("model.embed_tokens.weight", "lm_head.weight") and tensor.shape[0] > vocab:
            tensor = tensor[:vocab]
        yield name, tensor


def _export_stages(bridge: Any, models: list[torch.nn.Module]) -> Any:
    """mbridge's `export_weights` (each stage's weights broadcast over the pipeline group, so every rank
    yields all of them), each HF name once: with tied embeddings and several stages, the last stage holds
    its own copy of the embedding as the output layer (kept equal by megatron's embedding-group gradient
    all-reduce), which mbridge maps to the embedding's HF name a second time."""
    seen: set[str] = set()
    for name, tensor in bridge.export_weights(models):
        if name not in seen:
            seen.add(name)
            yield name, tensor


def _export_local(bridge: Any, models: list[torch.nn.Module]) -> Any:
    """mbridge's `export_weights` for a single pipeline stage of a dense model: the same loop over
    each chunk's parameters through mbridge's own name map, tensor-parallel merge and HF split,
    minus the pipeline exchange (three object collectives a tensor; on NCCL each pickles into GPU
    memory and synchronises the device, ~0.5 ms: most of a colocated sync of a 0.5B model)."""
    for model in unwrap_model(models):
        local_to_global = _local_to_global(bridge, model)
        for local_name, param, values in named_export_tensors(model):
            names, tensors = _to_hf(bridge, local_to_global[local_name], param, values)
            yield from zip(names, tensors, strict=True)


def _local_to_global(bridge: Any, model: torch.nn.Module) -> dict[str, str]:
    """mbridge's local -> global name map of a chunk, built once per chunk and kept while the chunk
    lives: mbridge walks the whole state dict for it (~3.5 ms at 0.5B on CPU, every sync), and a
    chunk's parameter names and layer numbers never change (without expert parallelism, the only
    case this serves, the map does not depend on the bridge)."""
    names = _LOCAL_TO_GLOBAL.get(model)
    if names is None:
        names = _LOCAL_TO_GLOBAL[model] = bridge._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
    return names


@torch.no_grad()  # views of parameters: no autograd graph (a plain function, so no_grad ends at return)
def _to_hf(bridge: Any, name: str, param: torch.Tensor,
           values: torch.Tensor | None = None) -> tuple[list[str], list[torch.Tensor]]:
    """One Megatron parameter as HF (names, tensors): TP shards gathered and merged, then split.
    `values` replaces the parameter's data (a LoRA-merged weight of the same shard shape)."""
    return bridge._weight_to_hf_format(name, gather_tensor_parallel(bridge, name, param, values))


@torch.no_grad()
def gather_tensor_parallel(bridge: Any, name: str, param: torch.Tensor,
                           values: torch.Tensor | None = None) -> torch.Tensor:
    """The whole Megatron tensor of a tensor-parallel parameter (mbridge's merge for `name`, a global
    Megatron name), or the parameter itself when it is not split. A collective over the TP group."""
    values = param if values is None else values
    if not getattr(param, "tensor_model_parallel", False):
        return values
    shards = [values]
    if bridge.mpu.tp_size > 1:
        shards = [torch.empty_like(values) for _ in range(bridge.mpu.tp_size)]
        dist.all_gather(shards, values.contiguous(), group=bridge.mpu.tp_group)
    return bridge._weight_merge_across_tp(name, shards, param)
