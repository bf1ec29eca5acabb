"""The parallel layout a config asks for, and whether its model can be split that way: checked before anything starts.

`parallel_layout(config)` derives who does what on the GPUs: the train ranks (`cluster.actor_num_nodes` x
`actor_num_gpus_per_node`) split as Megatron splits them, TP x PP x CP model-parallel groups (the `megatron:`
section's `tensor_model_parallel_size`, `pipeline_model_parallel_size`, `context_parallel_size`) and data
parallelism over what is left; the rollout engines (`cluster.rollout_num_gpus` in engines of
`rollout_num_gpus_per_engine` GPUs, which the built-in engine runs tensor parallel); colocated or not.

`check_layout(config, model)` refuses, with the numbers, what the layout cannot run, given the HF config of the
model (`model`, the checkpoint's config.json as a dict; None: only the model-free checks):

* TP x PP x CP must divide the train ranks; a step's samples (`global_batch_size`) must split evenly over the DP
  ranks (slime/ray/train_data.py `rank_share`);
* Megatron splits attention heads and key/value heads (query groups) over TP, layers over PP;
* the built-in engine splits heads, key/value heads (never replicated) and the MLP over its GPUs (`check_engine_tp`,
  which the engine itself runs at start, slime/engines/builtin/tp_shard.py). SGLang replicates KV heads itself.

The RL stage runs it before Ray starts (slime/rl/loop.py `check_rl_config`); everything here is arithmetic on the
config, so it runs on a machine without GPUs (tests/test_layout_x4.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slime.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    train_ranks: int
    tp: int
    pp: int
    cp: int
    dp: int
    engines: int
    gpus_per_engine: int
    colocate: bool
    gpus: int  # GPUs (Ray bundles) the rollout and train ranks take together, the eval fleet left out

    def describe(self) -> str:
        model = f"TP {self.tp} x PP {self.pp}" + (f" x CP {self.cp}" if self.cp > 1 else "")
        where = "colocated on" if self.colocate else "on"
        return (f"{self.train_ranks} train ranks = {model} x DP {self.dp}; {self.engines} engines of "
                f"{self.gpus_per_engine} GPU{'s' if self.gpus_per_engine > 1 else ''}; {where} {self.gpus} GPUs")


def _size(megatron: Mapping[str, Any], name: str) -> int:
    value = int(megatron.get(name) or 1)
    if value < 1:
        raise ConfigError(f"megatron.{name} {value} must be >= 1")
    return value


def parallel_layout(config: Any) -> ParallelLayout:
    """The layout `config` (a `Config`) asks for; ConfigError when TP x PP x CP does not divide the train ranks or
    the rollout GPUs are not whole engines."""
    cluster, megatron = config.cluster, config.megatron
    train = cluster.train_gpus
    tp, pp, cp = (_size(megatron, f"{kind}_parallel_size") for kind in ("tensor_model", "pipeline_model", "context"))
    if train % (tp * pp * cp):
        raise ConfigError(
            f"megatron.tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp}"
            + (f" x context_parallel_size {cp}" if cp > 1 else "")
            + f" = {tp * pp * cp} does not divide the {train} train ranks (cluster.actor_num_nodes "
            f"{cluster.actor_num_nodes} x actor_num_gpus_per_node {cluster.actor_num_gpus_per_node}): Megatron's "
            "data parallelism takes what is left, so the model-parallel group size must divide the train ranks")
    rollout, per_engine = cluster.rollout_gpus, cluster.rollout_num_gpus_per_engine
    if rollout % per_engine:
        raise ConfigError(f"cluster.rollout_num_gpus {rollout} is not a multiple of rollout_num_gpus_per_engine "
                          f"{per_engine}: engines take whole groups of GPUs")
    gpus = max(train, rollout) if cluster.same_gpus else train + rollout
    return ParallelLayout(train_ranks=train, tp=tp, pp=pp, cp=cp, dp=train // (tp * pp * cp),
                          engines=rollout // per_engine, gpus_per_engine=per_engine, colocate=cluster.colocate,
                          gpus=gpus)


def _field(model: Any, key: str) -> Any:
    return model.get(key) if isinstance(model, Mapping) else getattr(model, key, None)


def check_engine_tp(model: Any, world: int) -> None:
    """ConfigError, before any weight is loaded or rank started, when `model` (an HF config, or its config.json as a
    dict) cannot be split in `world` built-in engine ranks: whole attention heads and whole KV heads per rank (KV
    heads are split, not replicated), equal MLP and expert slices."""
    if world < 1:
        raise ConfigError(f"--tp-size must be at least 1, got {world}")
    heads = _field(model, "num_attention_heads")
    sizes = {"num_attention_heads": heads, "num_key_value_heads": _field(model, "num_key_value_heads") or heads}
    for key in ("moe_intermediate_size", "intermediate_size"):
        if _field(model, key):
            sizes[key] = _field(model, key)
    bad = [f"{key} {value}" for key, value in sizes.items() if value % world]
    if bad:
        raise ConfigError(f"--tp-size {world} does not divide {', '.join(bad)} of {_field(model, 'model_type')} model: "
                          "each rank takes whole attention heads and whole key/value heads (they are split, not "
                          f"replicated) and an equal slice of the MLP; use a --tp-size dividing "
                          f"{', '.join(str(v) for v in sizes.values())}")


def check_megatron_split(model: Any, layout: ParallelLayout, megatron: Mapping[str, Any]) -> None:
    """ConfigError when Megatron cannot split `model` (HF config or config.json dict) as `layout` says: attention
    heads and query groups (KV heads) over TP, layers over PP (unless the first/last stage sizes are given)."""
    heads = _field(model, "num_attention_heads")
    groups = _field(model, "num_key_value_heads") or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", groups)):
        if value % layout.tp:
            raise ConfigError(f"megatron.tensor_model_parallel_size {layout.tp} does not divide the model's {name} "
                              f"{value}: Megatron gives each TP rank whole heads and whole query groups (KV heads)")
    layers = _field(model, "num_hidden_layers")
    uneven = any(megatron.get(k) for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"))
    if layers and not uneven and layers % layout.pp:
        raise ConfigError(f"megatron.pipeline_model_parallel_size {layout.pp} does not divide the model's "
                          f"{layers} layers (set num_layers_in_first_pipeline_stage / _last_ for uneven stages)")


def check_layout(config: Any, model: Any = None) -> ParallelLayout:
    """The layout of `config`, checked (module docstring); `model`: the HF config (or config.json dict) or None."""
    layout = parallel_layout(config)
    run, train = config.run, config.train
    trains = not run.debug_rollout_only
    if trains and train.global_batch_size and train.global_batch_size % layout.dp:
        raise ConfigError(f"train.global_batch_size {train.global_batch_size} does not split over the {layout.dp} "
                          f"data-parallel ranks ({layout.describe()}): make it a multiple of {layout.dp}")
    if model is None:
        return layout
    if trains:
        check_megatron_split(model, layout, config.megatron)
    if not run.debug_train_only and config.engine.engine == "builtin" and not config.engine.rollout_external_engine_addrs:
        try:
            check_engine_tp(model, layout.gpus_per_engine)
        except ConfigError as exc:
            raise ConfigError(f"cluster.rollout_num_gpus_per_engine {layout.gpus_per_engine}: the built-in engine runs "
                              f"tensor parallel over its GPUs, and {exc}") from None
    return layout


def local_model_config(path: str | None) -> dict[str, Any] | None:
    """The config.json of a local HF model directory as a dict; None for a remote or missing one."""
    if not path or "://" in path:
        return None
    file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        return json.load(f)
