"""Megatron-LM / slime checkpoints (`--ckpt-format torch_dist`): read by `--load`, written by `slime export
--megatron-lm-layout`.

Megatron-LM's `save_checkpoint` (megatron/training/checkpointing.py: `generate_state_dict`, `get_rng_state`)
writes one torch_dist directory per iteration, of one state dict:

    {root}/latest_checkpointed_iteration.txt   "N" (or "release"), written once every rank's files are written
    {root}/iter_{N:07d}/common.pt              args (an argparse.Namespace), checkpoint_version 3.0, iteration,
                                               opt_param_scheduler, num_floating_point_operations_so_far, the
                                               optimizer's param_groups, content_metadata (sharding type, ...)
    {root}/iter_{N:07d}/*.distcp, .metadata, metadata.json
        state["model"]      the model's ShardedTensors, keyed without a prefix ("decoder.layers.mlp.linear_fc2.weight")
        state["optimizer"]  the optimizer's, in content_metadata's `distrib_optim_sharding_type` layout
        state["rng_state"]  a ShardedObject over (PP, TP): [python, numpy, torch, cuda, tracker states] of DP rank 0
    {root}/rollout/global_dataset_state_dict_{N}.pt   slime only: its data source's cursor

The tensors and their keys are the ones this project's checkpoints hold (both come from megatron-core's
`sharded_state_dict`; the local layer spec names its norms as Transformer Engine's fused ones), only split
there into `model/` and `optimizer/` with the rest as JSON (checkpoint.py). So loading reads the same tensors
under the other layout, and writing puts them back into one directory.

What carries over on load (each decision is logged in one line): the weights always (any TP/PP: torch_dist
reshards); the optimizer and LR schedule when the optimizer kinds agree (DistributedOptimizer or not), the
sharding type is one megatron-core 0.16.1 reads (dp_reshardable, fully_reshardable) and, for dp_reshardable,
TP and PP are the checkpoint's; the schedule converted from Megatron's sample counts to optimizer steps
(its `global_batch_size`); the RNG when TP and PP are the checkpoint's (as Megatron-LM decides); the iteration;
slime's data cursor when its `rollout/` file is there. Not: Megatron-LM's own data-loader position
(`consumed_train_samples`, which this project does not use), its rerun-state machine, and a LoRA model.

Trust: Megatron-LM pickles `args` into common.pt; we read common.pt, slime's cursor file and the RNG object
with torch's weights-only unpickler only (never `weights_only=False`): megatron-core's allowlist (argparse
Namespace, its enums, numpy arrays), and any other class an `args` field names is replaced by an inert
`UnreadArg` placeholder, whose code never runs. torch_dist's own `.metadata` index is read by torch's
`FileSystemReader` with `pickle`, for any torch_dist checkpoint, this project's included: load checkpoints
you trust (docs/megatron.md "Megatron-LM and slime checkpoints").
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import random
import re
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slime.backends.megatron import lora
from slime.backends.megatron.dist_checkpoint import (
    TrainingState,
    check_scheduler,
    save_strategy,
    single_chunk,
)
from slime.backends.megatron.optimizer import init_optimizer_state, is_distributed_optimizer, untie_adam_steps
from slime.backends.megatron.rng_state import set_tracker_states
from slime.errors import CheckpointMismatchError, ConfigError, MegatronLMCheckpointError
from slime.storage.manifest import is_committed

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's `generate_state_dict`: 3.0 since torch_dist
SLIME_CURSOR = os.path.join("rollout", "global_dataset_state_dict_{iteration}.pt")
CURSOR_FIELDS = ("epoch_id", "sample_offset", "sample_group_index", "sample_index")
# OptimizerParamScheduler fields Megatron-LM counts in samples (it steps by the global batch) and this project
# in optimizer steps (optimizer.py)
SAMPLE_COUNTS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")
READABLE_SHARDING = ("dp_reshardable", "fully_reshardable")  # fully_sharded_model_space fails in 0.16.1
_ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")
# Megatron-LM's check_checkpoint_args compares these with the model it loads into
ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "num_attention_heads")


class UnreadArg:
    """Stands for an `args` field of a class outside the weights-only allowlist: the checkpoint's class is never
    imported nor run, so the field's value is unknown here."""

    def __new__(cls, *args: Any, **kwargs: Any) -> UnreadArg:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __repr__(self) -> str:
        return "<unread>"


@dataclass
class MegatronLMCheckpoint:
    """One iteration of a Megatron-LM checkpoint: its directory and what common.pt holds (weights-only)."""

    path: str
    root: str
    iteration: int
    common: dict[str, Any]
    args: dict[str, Any] | None  # fields of its `args` Namespace; None when it has none
    unread: list[str] = field(default_factory=list)  # classes an `args` field named, not unpickled

    def arg(self, name: str, default: Any = None) -> Any:
        value = (self.args or {}).get(name, default)
        return default if isinstance(value, UnreadArg) else value

    @property
    def content_metadata(self) -> dict[str, Any]:
        return dict(self.common.get("content_metadata") or {})

    @property
    def tp_pp(self) -> tuple[int, int]:
        """(TP, PP) it was saved with; Megatron-LM assumes 1 where its args do not say."""
        return int(self.arg("tensor_model_parallel_size", 1)), int(self.arg("pipeline_model_parallel_size", 1))

    @property
    def sharding(self) -> str | None:
        """The DistributedOptimizer's sharding type, or None for the standard optimizer. Checkpoints of megatron-core
        < 0.13 have no content metadata: Megatron-LM's own guess from their args."""
        meta = self.content_metadata
        if "distrib_optim_sharding_type" in meta:
            return meta["distrib_optim_sharding_type"]
        if not meta and self.arg("use_distributed_optimizer"):
            return "fully_sharded_model_space" if self.arg("ckpt_fully_parallel_save") else "dp_zero_gather_scatter"
        return None


# ----------------------------------------------------------------------------- which directory


def megatron_lm_iteration_dir(load: str) -> str | None:
    """The iteration directory of the Megatron-LM checkpoint `load` names: a root (its tracker file's iteration)
    or an `iter_NNNNNNN` directory of one. None when `load` is not one (this project's own checkpoints have a
    manifest.json and no tracker). A tracker naming a missing iteration, or the legacy torch format, is refused."""
    if "://" in load or not os.path.isdir(load):
        return None
    tracker = os.path.join(load, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text != "release" and not text.isdigit():
            raise MegatronLMCheckpointError(f"{tracker} holds {text!r}: neither an iteration number nor 'release'")
        path = os.path.join(load, "release" if text == "release" else f"iter_{int(text):07d}")
        if not os.path.isdir(path):
            raise MegatronLMCheckpointError(
                f"{tracker} names iteration {text}, but {path} does not exist (a save that did not finish, or a "
                "deleted iteration): pass an existing iter_NNNNNNN directory as --load, or correct the tracker file")
    elif _ITER_DIR.match(os.path.basename(os.path.normpath(load))) and not is_committed(load) and (
            os.path.isfile(os.path.join(load, "common.pt")) or _legacy_files(load)):
        path = load
    else:
        return None
    _check_format(path)
    return path


def is_megatron_lm_checkpoint(path: str) -> bool:
    return megatron_lm_iteration_dir(path) is not None


def _legacy_files(path: str) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.startswith("mp_rank_"))


def _check_format(path: str) -> None:
    """torch_dist only: the legacy per-rank torch format is refused with Megatron-LM's conversion command."""
    legacy = _legacy_files(path)
    if legacy:
        raise MegatronLMCheckpointError(
            f"{path} is a Megatron-LM checkpoint in the legacy torch format ({legacy[0]}/model_optim_rng.pt), which "
            "is not read here. Convert it to torch_dist with Megatron-LM: run its training script with your model's "
            "flags and `--load ROOT --ckpt-format torch --ckpt-convert-format torch_dist --ckpt-convert-save OUT`, "
            "then pass OUT/torch_dist as --load")
    config = os.path.join(path, "metadata.json")
    if not os.path.isfile(config):
        raise MegatronLMCheckpointError(f"{path} has no metadata.json: not a complete torch_dist checkpoint")
    with open(config) as f:
        backend = json.load(f).get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronLMCheckpointError(f"{config}: sharded backend {backend!r}; only torch_dist is read here")


# ----------------------------------------------------------------------------- reading, weights-only


def read_megatron_lm_checkpoint(path: str) -> MegatronLMCheckpoint:
    """common.pt of the iteration directory `path`, unpickled weights-only (module docstring, "Trust")."""
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    common_path = os.path.join(path, COMMON_STATE_FNAME)
    if not os.path.isfile(common_path):
        raise MegatronLMCheckpointError(f"{path} has no {COMMON_STATE_FNAME}: not a Megatron-LM torch_dist checkpoint")
    common, unread = _weights_only_load(common_path)
    if unread:
        logger.warning("%s: args fields of classes outside the weights-only allowlist were not unpickled (%s); "
                       "their values are unknown here", common_path, ", ".join(unread))
    raw_args = common.pop("args", None)
    args = dict(vars(raw_args)) if isinstance(raw_args, Namespace) else None
    iteration = 0 if os.path.basename(os.path.normpath(path)) == "release" else int(common.get("iteration", 0))
    return MegatronLMCheckpoint(path=path, root=os.path.dirname(os.path.normpath(path)), iteration=iteration,
                                common=common, args=args, unread=unread)


def _weights_only_load(source: str | io.BytesIO) -> tuple[Any, list[str]]:
    """`torch.load(weights_only=True)` with megatron-core's allowlist; any other class is an `UnreadArg`."""
    import megatron.core  # noqa: F401  (registers megatron-core's weights-only allowlist)

    if isinstance(source, io.BytesIO):
        source.seek(0)
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    known = {f"{obj.__module__}.{obj.__qualname__}" for obj in _allowed()}
    unread = sorted(name for name in unsafe if name not in known)
    if isinstance(source, io.BytesIO):
        source.seek(0)
    with torch.serialization.safe_globals([*_allowed(), *((UnreadArg, name) for name in unread)]):
        return torch.load(source, map_location="cpu", weights_only=True), unread


def _allowed() -> list[Any]:
    from megatron.core.safe_globals import SAFE_GLOBALS

    return [*SAFE_GLOBALS, Namespace, torch._C.Generator]


def _read_rng(ckpt: MegatronLMCheckpoint, tp_rank: int, pp_rank: int) -> dict[str, Any]:
    """This rank's entry of the checkpoint's `rng_state` ShardedObject, read weights-only: torch's DCP planner
    would unpickle it with `weights_only=False` (megatron-core's load path does)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    read: dict[str, Any] = {}

    class WeightsOnlyBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded, unread = _weights_only_load(io.BytesIO(value.read()))
            if unread:
                raise MegatronLMCheckpointError(f"rng_state names classes outside the allowlist: {unread}")
            read[read_item.dest_index.fqn] = loaded

    tp, pp = ckpt.tp_pp
    key = f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"  # megatron ShardedObject.unique_key
    dcp_load({key: io.BytesIO()}, storage_reader=FileSystemReader(ckpt.path), planner=WeightsOnlyBytes(),
             no_dist=True)
    (states,) = read[key]  # torch_dist saves [object.data]: Megatron-LM's list of DP ranks' states
    dp_rank = _dp_rank()
    return states[dp_rank] if ckpt.arg("data_parallel_random_init") and len(states) > dp_rank else states[0]


def _read_slime_cursor(ckpt: MegatronLMCheckpoint) -> dict[str, int] | None:
    """slime's data-source cursor saved with this iteration (a torch.save of a dict of ints), if any."""
    path = os.path.join(ckpt.root, SLIME_CURSOR.format(iteration=ckpt.iteration))
    if not os.path.isfile(path):
        return None
    state, unread = _weights_only_load(path)
    if unread or not isinstance(state, dict):
        logger.warning("%s: not slime's data-source state as expected (%s); the data cursor is not restored", path,
                       unread or type(state).__name__)
        return None
    return {name: int(state.get(name, 0)) for name in CURSOR_FIELDS}


# ----------------------------------------------------------------------------- load


def _preloaded_common(common: dict[str, Any]) -> Any:
    """megatron-core's common-load strategy, but handing out the common state we already read weights-only (its
    own would load common.pt again, and refuse an `args` field outside the allowlist)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class Preloaded(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> dict[str, Any]:
            return copy.deepcopy(common)  # megatron merges the loaded tensors into it

    return Preloaded()


@contextlib.contextmanager
def _weights_only_objects() -> Iterator[None]:
    """While loading a Megatron-LM checkpoint, megatron's DCP planner unpickles ShardedObjects (the
    DistributedOptimizer's bucket sizes, ...) weights-only, where torch's planner it inherits uses
    `weights_only=False`. Scoped to our own loads: the method is restored after."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    def load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
        loaded, unread = _weights_only_load(io.BytesIO(value.read()))
        if unread:
            raise MegatronLMCheckpointError(f"{read_item.dest_index.fqn}: an object of classes outside the "
                                            f"weights-only allowlist ({', '.join(unread)}); not unpickled")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    own = vars(MCoreLoadPlanner).get("load_bytes")
    MCoreLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        if own is None:
            del MCoreLoadPlanner.load_bytes
        else:
            MCoreLoadPlanner.load_bytes = own


def _load(ckpt: MegatronLMCheckpoint, sharded: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        with _weights_only_objects():
            return dist_checkpointing.load(sharded, ckpt.path, common_strategy=_preloaded_common(ckpt.common))
    except CheckpointingException as exc:
        raise CheckpointMismatchError(f"{ckpt.path}: {exc}; build the model with the configuration of the model the "
                                      "checkpoint was trained from") from exc


def load_megatron_lm_model(models: list[torch.nn.Module], path: str) -> MegatronLMCheckpoint:
    """The weights of a Megatron-LM checkpoint's iteration directory `path` into `models`, any TP/PP (torch_dist
    reshards); into a LoRA model its base. The architecture in its args is checked first, as Megatron-LM does."""
    from megatron.core.utils import get_model_config

    ckpt = read_megatron_lm_checkpoint(path)
    config = get_model_config(models[0])
    for arg in ARCHITECTURE_ARGS:
        saved, mine = ckpt.arg(arg), getattr(config, arg)
        if saved is not None and saved != mine:
            raise CheckpointMismatchError(f"{path}: {arg} is {saved!r} in the checkpoint's args but {mine!r} in the "
                                          "model loading it; build the model with the checkpoint's configuration")
    model = single_chunk(models)
    adapted = lora.has_adapters(model)
    # not the layers' `_extra_state` (Transformer Engine's FP8 metadata in a TE checkpoint; None in the local spec)
    sharded = {k: v for k, v in model.sharded_state_dict().items()
               if not k.endswith("_extra_state") and not (adapted and lora.is_adapter_name(k))}
    loaded = _load(ckpt, {"model": sharded})["model"]
    own = model.state_dict()
    state = {k: v for k, v in loaded.items() if k in own}
    missing = [k for k in own if k not in state and not k.endswith("_extra_state")
               and not (adapted and lora.is_adapter_name(k))]
    if missing:
        raise CheckpointMismatchError(f"{path}: the checkpoint lacks weights of this model: {missing[:3]}")
    model.load_state_dict(state, strict=False)
    return ckpt


def load_megatron_lm_checkpoint(models: list[torch.nn.Module], path: str, optimizer: Any, scheduler: Any = None, *,
                                load_optim: bool = True, load_rng: bool = True) -> TrainingState:
    """Start from a Megatron-LM / slime checkpoint as Megatron-LM's `--load` does (a collective call): weights,
    then optimizer and LR schedule where the layouts agree, RNG where TP and PP agree, the iteration, and slime's
    data cursor as `extra_state["slime_data_source"]`. One log line says what carried over and why not the rest."""
    from megatron.core import parallel_state

    ckpt = load_megatron_lm_model(models, path)
    tp_pp = (parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_pipeline_model_parallel_world_size())
    carried, left = [f"weights (TP {ckpt.tp_pp[0]} PP {ckpt.tp_pp[1]} -> TP {tp_pp[0]} PP {tp_pp[1]})"], []

    why_not = "--no-load-optim" if not load_optim else _optimizer_disagreement(ckpt, optimizer, tp_pp)
    if why_not is None and scheduler is not None:
        saved = _schedule_in_steps(ckpt)
        if saved is None:
            why_not = ("the checkpoint has no LR schedule, or no global_batch_size in its args to convert Megatron's "
                       "sample counts to optimizer steps")
        else:
            check_scheduler(saved, scheduler.state_dict(), path)  # a different schedule is the user's: refused
    if why_not is None:
        _load_optimizer(ckpt, models, optimizer)
        if scheduler is not None:
            scheduler.load_state_dict(saved)
        carried.append(f"optimizer and LR schedule ({ckpt.sharding or 'standard optimizer'})")
    else:
        optimizer.reload_model_params()  # the fresh optimizer's main params from the loaded weights
        left.append(f"optimizer and LR schedule (start fresh: {why_not})")

    if not load_rng:
        left.append("RNG (--no-load-rng)")
    elif ckpt.arg("no_save_rng") or ckpt.tp_pp != tp_pp:
        left.append("RNG (" + ("saved with --no-save-rng" if ckpt.arg("no_save_rng") else
                               f"TP/PP {ckpt.tp_pp} -> {tp_pp}: per-rank streams, ignored as Megatron-LM does") + ")")
    else:
        try:
            _restore_rng(_read_rng(ckpt, parallel_state.get_tensor_model_parallel_rank(),
                                   parallel_state.get_pipeline_model_parallel_rank()))
            carried.append("RNG")
        except Exception as exc:  # a missing or unreadable rng_state: training goes on from the current streams
            left.append(f"RNG (unreadable: {exc})")

    extra: dict[str, Any] = {}
    cursor = _read_slime_cursor(ckpt)
    if cursor is not None:
        extra["slime_data_source"] = cursor
        carried.append("slime's data cursor")
    else:
        left.append("data cursor (no rollout/global_dataset_state_dict file: Megatron-LM's own data-loader position "
                    "is not used here)")
    if ckpt.args is None:
        left.append("args (none saved)")
    logger.info("loaded Megatron-LM checkpoint %s (iteration %d): carried over %s; not carried over: %s", path,
                ckpt.iteration, ", ".join(carried), "; ".join(left) or "nothing")
    return TrainingState(iteration=ckpt.iteration, extra_state=extra)


def _optimizer_disagreement(ckpt: MegatronLMCheckpoint, optimizer: Any, tp_pp: tuple[int, int]) -> str | None:
    """Why the checkpoint's optimizer state cannot be loaded into `optimizer`, or None when it can."""
    if "optimizer" not in ckpt.common or ckpt.arg("no_save_optim"):
        return "the checkpoint holds no optimizer state (--no-save-optim)"
    mine = is_distributed_optimizer(optimizer)
    if (ckpt.sharding is not None) != mine:
        kinds = ("the DistributedOptimizer", "the standard optimizer")
        return f"saved by {kinds[ckpt.sharding is None]}, loading into {kinds[not mine]}"
    if ckpt.sharding is not None and ckpt.sharding not in READABLE_SHARDING:
        return (f"sharding type {ckpt.sharding!r} is not read by megatron-core 0.16.1 without Apex/TE (re-save it with "
                "--dist-ckpt-optim-fully-reshardable)")
    if ckpt.sharding == "dp_reshardable" and ckpt.tp_pp != tp_pp:
        return f"dp_reshardable needs the saved TP/PP {ckpt.tp_pp}, not {tp_pp}"
    return None


def _schedule_in_steps(ckpt: MegatronLMCheckpoint) -> dict[str, Any] | None:
    """The checkpoint's OptimizerParamScheduler state, its sample counts divided by its global batch size."""
    saved = ckpt.common.get("opt_param_scheduler") or ckpt.common.get("lr_scheduler")
    batch = ckpt.arg("global_batch_size")
    if saved is None or not batch:
        return None
    return {k: (v // batch if k in SAMPLE_COUNTS and isinstance(v, int) else v) for k, v in saved.items()}


def _load_optimizer(ckpt: MegatronLMCheckpoint, models: list[torch.nn.Module], optimizer: Any) -> None:
    """The checkpoint's optimizer state, with the content metadata it was saved with (key layout and sharding)."""
    model = single_chunk(models)
    init_optimizer_state(optimizer)  # fix 1 (optimizer.py): megatron's load path builds a state dict of the current state
    sharded = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True,
                                           metadata=_content_metadata(ckpt.sharding) | ckpt.content_metadata)
    optimizer.load_state_dict(_load(ckpt, {"optimizer": sharded})["optimizer"])
    init_optimizer_state(optimizer)
    untie_adam_steps(optimizer)  # fix 3


def _restore_rng(state: dict[str, Any]) -> None:
    """Megatron-LM's per-rank generator states (`get_rng_state`) into this process's generators."""
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    set_tracker_states({name: s.get_state() if isinstance(s, torch.Generator) else s
                        for name, s in state["rng_tracker_states"].items()})


# ----------------------------------------------------------------------------- write


def save_megatron_lm_checkpoint(models: list[torch.nn.Module], root: str, iteration: int, *, optimizer: Any = None,
                                scheduler_state: dict[str, Any] | None = None, samples_per_step: int | None = None,
                                fully_reshardable: bool = False, with_rng: bool = True) -> str:
    """Write `models` (and `optimizer`, the scheduler state, this process's RNG) as Megatron-LM's `save_checkpoint`
    with `--ckpt-format torch_dist` does, to `{root}/iter_{iteration:07d}`, then the tracker file (a collective
    call). Returns the iteration directory.

    The schedule is written in Megatron-LM's sample counts: this project's step counts times `samples_per_step`
    (the global batch size; 1, with a warning, when unknown). Without an optimizer the args say --no-save-optim,
    without RNG --no-save-rng, so that Megatron-LM's `load_checkpoint` asks for neither."""
    from megatron.core import dist_checkpointing

    model = single_chunk(models)
    if lora.has_adapters(model):
        raise ConfigError("a LoRA model has no Megatron-LM layout here: export merged HF weights, or keep this "
                          "project's checkpoint")
    path = os.path.join(root, f"iter_{iteration:07d}")
    exists = os.path.exists(path)
    _barrier()  # every rank has looked before rank 0 creates it below (a rank that looked later saw rank 0's)
    if exists:
        raise ConfigError(f"{path} already exists; choose another --output-dir")
    if optimizer is not None and scheduler_state is None:
        raise ConfigError("a Megatron-LM checkpoint with optimizer state needs the LR schedule too "
                          "(Megatron-LM loads them together)")
    if optimizer is not None and samples_per_step is None:
        logger.warning("the global batch size is unknown: the LR schedule is written in optimizer steps (global_batch_"
                       "size 1); Megatron-LM counts samples, so load it there with --override-opt-param-scheduler")
    batch = samples_per_step or 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        os.makedirs(path)
    _barrier()
    sharding = ("fully_reshardable" if fully_reshardable else "dp_reshardable") \
        if optimizer is not None and is_distributed_optimizer(optimizer) else None
    content = _content_metadata(sharding)
    state: dict[str, Any] = {
        "args": _args(models, iteration, optimizer, batch, with_rng, sharding),
        "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
        "model": model.sharded_state_dict(metadata=content), "num_floating_point_operations_so_far": 0}
    if optimizer is not None:
        init_optimizer_state(optimizer)  # fix 1 (optimizer.py)
        state["optimizer"] = optimizer.sharded_state_dict(model.sharded_state_dict(metadata=content),
                                                          is_loading=False, metadata=content)
        state["opt_param_scheduler"] = {k: (v * batch if k in SAMPLE_COUNTS else v) for k, v in scheduler_state.items()}
    if with_rng:
        state["rng_state"] = _rng_object()
    dist_checkpointing.save(state, path, save_strategy(), content_metadata=content)
    _barrier()
    if rank == 0:  # the tracker last, as Megatron-LM's finalize does: a crash leaves the previous iteration named
        tmp = os.path.join(root, f".{TRACKER}.tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    _barrier()
    logger.info("wrote Megatron-LM checkpoint %s (model%s%s)", path,
                f", optimizer ({sharding or 'standard'}) and LR schedule" if optimizer is not None else "",
                ", RNG" if with_rng else "")
    return path


def _content_metadata(sharding: str | None) -> dict[str, Any]:
    """Megatron-LM's `_build_sharded_state_dict_metadata`, less its process group (not saved)."""
    meta: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if sharding is not None:
        meta["distrib_optim_sharding_type"] = sharding
        if sharding == "fully_reshardable":
            meta["distrib_optim_fully_reshardable_mem_efficient"] = False
    return meta


def _args(models: list[torch.nn.Module], iteration: int, optimizer: Any, batch: int, with_rng: bool,
          sharding: str | None) -> Namespace:
    """The args Megatron-LM's `load_checkpoint` reads (check_checkpoint_args, the TP/PP decisions, no_save_*) and
    the model shape `--use-checkpoint-args` takes; plain values only, so it loads weights-only.
    `add_position_embedding` is left out on purpose: Megatron-LM defaults it to True and compares it with its
    run's flag, which RoPE models leave at True or set False depending on the script."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    config = get_model_config(models[0])
    model = single_chunk(models)
    dtype = config.params_dtype
    return Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        group_query_attention=(config.num_query_groups or config.num_attention_heads) != config.num_attention_heads,
        kv_channels=config.kv_channels, normalization=config.normalization, norm_epsilon=config.layernorm_epsilon,
        swiglu=bool(config.gated_linear_unit), add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm, position_embedding_type=getattr(model, "position_embedding_type", None),
        max_position_embeddings=getattr(model, "max_position_embeddings", None),
        rotary_base=getattr(getattr(model, "rotary_pos_emb", None), "rotary_base", None),
        untie_embeddings_and_output_weights=not model.share_embeddings_and_output_weights,
        padded_vocab_size=model.vocab_size, params_dtype=dtype, bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        use_distributed_optimizer=sharding is not None, dist_ckpt_optim_fully_reshardable=sharding == "fully_reshardable",
        ckpt_format="torch_dist", use_dist_ckpt=True, iteration=iteration, global_batch_size=batch,
        consumed_train_samples=iteration * batch, skipped_train_samples=0, consumed_valid_samples=0,
        no_save_optim=optimizer is None, no_save_rng=not with_rng, data_parallel_random_init=False)


def _rng_object() -> Any:
    """This rank's generators as Megatron-LM's `get_rng_state(ckpt_format="torch_dist")` shards them: one object per
    (PP, TP) rank, written by DP rank 0 (replica_id: the DP rank)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = {name: s.get_state() if isinstance(s, torch.Generator) else s
               for name, s in get_cuda_rng_tracker().get_states().items()}
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state(),
             "rng_tracker_states": tracker}
    return ShardedObject("rng_state", [state],
                         (parallel_state.get_pipeline_model_parallel_world_size(),
                          parallel_state.get_tensor_model_parallel_world_size()),
                         (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def _dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

