"""Checks of the pass-through sections: `sglang` and `router` flags against SGLang's and sglang-router's own
tables, `megatron` options against megatron-core's config dataclasses (`megatron_flag_names`) and Megatron-LM's
launch flags (slime/config/megatron_flags.py)."""

from __future__ import annotations

import dataclasses
import functools
import warnings

from slime.config.base import Fail, _suggest
from slime.config.engine_flags import check_router_args, check_sglang_args
from slime.config.megatron_flags import LAUNCH, LAUNCH_ACCEPTED, launch_problems, option_problems
from slime.config.slime_flags import RAY_CLI, refusal
from slime.config.tree import FIELD_SECTION, Config
from slime.errors import ConfigError


def check_engine_args(config: Config, where: dict[str, str]) -> None:
    """Every `sglang` and `router` flag is one SGLang or sglang-router takes, named by where it was set."""
    if config.sglang or config.router:
        for section, check in (("sglang", check_sglang_args), ("router", check_router_args)):
            for key, value in getattr(config, section).items():
                try:
                    check({key: value})
                except ConfigError as exc:
                    raise ConfigError(f"{where.get(f'{section}.{key}', 'config')}: {exc}") from None


def check_megatron(config: Config, fail: Fail) -> None:
    """Every `megatron` option is a Megatron flag this project accepts, with a value it supports."""
    t = config.train
    refused = sorted(name for name in config.megatron if refusal(name))
    if refused:  # one of slime's own flags this project does not do: say why rather than pass it on
        name = refused[0]
        fail(f"megatron.{name}", f"slime's --{name.replace('_', '-')} is not supported here: {refusal(name)}")
    if int(config.megatron.get("virtual_pipeline_model_parallel_size") or 1) > 1:
        fail("megatron.virtual_pipeline_model_parallel_size", "virtual pipeline stages (interleaved 1F1B) are not "
             "supported by the Megatron backend: it runs one model chunk per rank (pipeline_model_parallel_size "
             "alone is supported)")
    cluster = config.cluster
    for field, why in option_problems(config.megatron,
                                      offload_train=cluster.colocate if cluster.offload_train is None
                                      else bool(cluster.offload_train),
                                      dynamic_batch=t.use_dynamic_batch_size):
        fail(field, why, *(name for name in ("megatron.cuda_graph_impl", "megatron.enable_cuda_graph", "cluster.colocate",
                                             "cluster.offload") if name != field))
    typed = sorted(set(config.megatron) & set(FIELD_SECTION))
    if typed:  # e.g. `megatron: {lr_decay_style: cosine}`: the typed field is the one the trainer reads
        name = typed[0]
        fail(f"megatron.{name}", f"{name} is a typed field: set it as {FIELD_SECTION[name]}.{name} "
             f"(--{name.replace('_', '-')}), not in the megatron pass-through section")
    for field, why in launch_problems(config.megatron):  # Megatron-LM launch flags refused or mis-valued
        fail(field, why)
    if config.megatron:
        unknown = sorted(set(config.megatron) - megatron_flag_names() - LAUNCH_ACCEPTED)
        if unknown:
            name = unknown[0]
            hint = f"; {RAY_CLI[name]}" if name in RAY_CLI else _suggest(
                name, [*FIELD_SECTION, *megatron_flag_names(), *LAUNCH]).replace("_", "-")
            fail(f"megatron.{name}", f"unknown option --{name.replace('_', '-')}{hint}")


@functools.cache
def megatron_flag_names() -> frozenset[str]:
    """Megatron options this project accepts: fields of megatron-core's config dataclasses plus the
    scheduler/model-shape flags Megatron's own parser defines outside them."""

    with warnings.catch_warnings():  # megatron warns at import when Transformer Engine / apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer import TransformerConfig

    names = {f.name for cls in (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig)
             for f in dataclasses.fields(cls)}
    names |= {
        "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by", "vocab_size",
        "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_init",
        "start_weight_decay", "end_weight_decay", "weight_decay_incr_style", "untie_embeddings_and_output_weights",
        "position_embedding_type", "rotary_base", "use_rotary_position_embeddings", "normalization",
        "swiglu", "disable_bias_linear", "add_qkv_bias", "group_query_attention", "num_query_groups",
        "norm_epsilon", "transformer_impl", "recompute_activations", "distributed_backend",
        "sequence_parallel", "use_distributed_optimizer", "ckpt_format", "use_precision_aware_optimizer",
        "use_pytorch_profiler", "profile_step_start", "profile_step_end",  # slime's profiling (profile.py)
        "padded_vocab_size",  # slime's model vocabulary size (convert.vocab_padding)
    }
    return frozenset(names)
