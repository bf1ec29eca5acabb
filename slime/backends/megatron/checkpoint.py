"""Megatron checkpoints: torch_dist model and optimizer, scheduler, RNG and caller state, committed by a manifest.

Layout (a local path: torch_dist writes to a filesystem):

    {save}/iter_{N:07d}/model/               torch_dist (megatron-core dist_checkpointing) of the model
    {save}/iter_{N:07d}/optimizer/           torch_dist of megatron's sharded optimizer state
    {save}/iter_{N:07d}/training_state.json  iteration, LR scheduler state, the caller's `extra_state`
    {save}/iter_{N:07d}/rng/rank_RRRRR.json  every random generator of each rank (`rng_state`)
    {save}/iter_{N:07d}/manifest.json        written last: model signature, parallel layout, contents, ...

A model-only checkpoint (conversion, `--no-save-optim`) has just `model/` and the manifest. A checkpoint
exists only once its manifest does; `latest_checkpoint` returns the newest committed iteration, so a
crash mid-save leaves the previous checkpoint as the newest. With `remote` (train ranks on several nodes,
a remote store: `slime/storage/node_staging.py`), `save` is each node's local staging directory: every node
uploads its own files to `{remote}/iter_N`, and the manifest is written there only, last.

With LoRA adapters on the model (`lora.py`), `model/` holds the adapters only and the manifest's `lora`
entry records their rank, alpha, targets and the base they belong to (its source and content hash):
loading such a checkpoint needs the same base already in the model, and loading a full checkpoint into
a LoRA model fills its base.

Loading checks before it touches any tensor: the architecture and dtype recorded in the manifest must
match the model loaded into (always), and for a full training-state resume also the parallel layout
(TP, PP, DP, DistributedOptimizer) and the LR schedule; each refusal names the differing field.
`load_model_checkpoint` loads weights only (conversion output, `--ref-load`, export);
`load_checkpoint` restores the whole training state for a bit-exact resume, or all of it but the optimizer
and schedule (Megatron's --no-load-optim) or the RNG (--no-load-rng).

A Megatron-LM / slime checkpoint (`latest_checkpointed_iteration.txt` + `iter_NNNNNNN/`, one torch_dist directory
without manifest) is resolved and loaded by the same three calls, through megatron_lm.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.megatron import lora, megatron_lm
from slime.backends.megatron.async_save import AsyncSaver
from slime.backends.megatron.bridge import ARCHITECTURE_FIELDS
from slime.backends.megatron.dist_checkpoint import (
    TrainingState,
    check_scheduler,
    save_strategy,
    single_chunk,
)
from slime.backends.megatron.optimizer import (
    init_optimizer_state,
    is_distributed_optimizer,
    restore_zero_steps,
    untie_adam_steps,
)
from slime.backends.megatron.rng_state import capture_rng_state, restore_rng_state
from slime.errors import (
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    CorruptArtifactError,
    ModelOnlyCheckpointError,
    NotCommittedError,
    UncommittedCheckpointError,
)
from slime.storage.fs import join_uri, open_fs
from slime.storage.manifest import (
    FileEntry,
    Manifest,
    commit_directory,
    is_committed,
    producer_info,
    read_manifest,
)
from slime.storage.node_staging import commit_from_nodes, is_node_leader

logger = logging.getLogger(__name__)

CHECKPOINT_KIND = "checkpoint"
TRAINING_STATE = "training_state.json"
_ITER = re.compile(r"^iter_(\d{7})$")


def iteration_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def latest_checkpoint(save: str) -> str | None:
    """The newest committed `iter_*` directory under `save`, or None."""
    if not os.path.isdir(save):
        return None
    iterations = sorted((int(m.group(1)), name) for name in os.listdir(save) if (m := _ITER.match(name)))
    for _, name in reversed(iterations):
        path = os.path.join(save, name)
        if is_committed(path):
            return path
    return None


# ----------------------------------------------------------------------------- which checkpoint


def resolve_checkpoint(load: str) -> str:
    """`load` itself when it is a committed checkpoint, else the newest committed one under it; for a Megatron-LM /
    slime checkpoint (root or iteration directory) the iteration directory its tracker file names."""

    foreign = megatron_lm.megatron_lm_iteration_dir(load)  # first: an export's root also has a manifest
    if foreign is not None:
        return foreign
    if is_committed(load):
        return load
    latest = latest_checkpoint(load)
    if latest is None:
        raise NotCommittedError(f"{load} holds no committed checkpoint (no iter_*/manifest.json)")
    return latest


def reference_checkpoint(checkpoint: Any) -> str:
    """The checkpoint `checkpoint.ref_load` names (`checkpoint` a `CheckpointConfig`): its iteration
    `ref_ckpt_step` when set (a remote root stages that iteration, slime/storage/staging.py), else as
    `resolve_checkpoint`."""
    return _iteration_checkpoint(checkpoint.ref_load, checkpoint.ref_ckpt_step, "ref_load", "ref_ckpt_step")


def teacher_checkpoint(checkpoint: Any) -> str:
    """The on-policy distillation teacher `checkpoint.opd_teacher_load` names: its iteration
    `opd_teacher_ckpt_step` when set, else as `resolve_checkpoint` (as `reference_checkpoint`)."""
    return _iteration_checkpoint(checkpoint.opd_teacher_load, checkpoint.opd_teacher_ckpt_step, "opd_teacher_load",
                                 "opd_teacher_ckpt_step")


def _iteration_checkpoint(root: str, step: int | None, root_field: str, step_field: str) -> str:
    if step is None:
        return resolve_checkpoint(root)
    path = iteration_dir(root, step)
    if not is_committed(path):
        raise NotCommittedError(f"checkpoint.{step_field} {step}: {path} is not a committed "
                                f"checkpoint (checkpoint.{root_field} must be a --save root holding it)")
    return path


# ----------------------------------------------------------------------------- save


def save_checkpoint(models: list[torch.nn.Module], save: str, iteration: int, *, optimizer: Any = None,
                    scheduler: Any = None, extra_state: dict[str, Any] | None = None,
                    metadata: dict[str, Any] | None = None, config_hash: str | None = None,
                    fully_reshardable: bool = False, remote: str | None = None,
                    storage_options: dict[str, Any] | None = None, keep: int | None = None,
                    saver: AsyncSaver | None = None) -> Manifest | None:
    """Save under `{save}/iter_N` on every rank (a collective call) and commit it.

    With `optimizer` (and `scheduler`), the full training state is saved: optimizer state (for the
    DistributedOptimizer in the 'fully_reshardable' format when asked, else 'dp_reshardable'), scheduler,
    RNG of every rank, `iteration` and the JSON-serialisable `extra_state`. Without, the model only:
    that is what `--no-save-optim` means, so callers pass `optimizer=None` when it is set.

    With `remote` (a URL), `save` is this node's staging directory and the checkpoint is committed at
    `{remote}/iter_N` from every node's files (`node_staging.commit_from_nodes`), not locally.
    With `keep`, once committed, only the newest `keep` committed checkpoints under the root stay
    (`prune_checkpoints`). With `saver` (`--async-save`), the state is copied to host memory and written in
    the background: this returns None at once, and the checkpoint is committed by a later `saver.poll()`
    or `saver.wait()` (`async_save.py`); without, the committed manifest is returned.
    """
    from megatron.core import dist_checkpointing

    path = iteration_dir(save, iteration)
    target = join_uri(remote, os.path.basename(path)) if remote else path
    if saver is not None:
        saver.wait()  # one save in flight at a time; and `path` may be the one still writing
    if is_committed(path) or (remote and is_committed(target, storage_options)):
        raise ConfigError(f"{target} is already a committed checkpoint; use another --save or iteration")
    extra_json = json.dumps(extra_state or {})  # fail before writing anything if it is not JSON
    rank = dist.get_rank() if dist.is_initialized() else 0
    cleans = is_node_leader(path) if remote else rank == 0  # with remote, each node has its own directory
    if cleans and os.path.isdir(path):
        shutil.rmtree(path)  # leftovers of a save that never committed
    _barrier()
    os.makedirs(path, exist_ok=True)
    model = single_chunk(models)
    adapters = lora.lora_metadata(model)
    if adapters is not None and adapters["base"] is None:
        raise ConfigError("a LoRA checkpoint records the base its adapters belong to: call lora.set_base after "
                          "loading the base weights")
    rng = capture_rng_state() if optimizer is not None else None
    strategy = save_strategy()
    requests = []

    def write(state: dict[str, Any], directory: str) -> None:
        if saver is None:
            requests.append(dist_checkpointing.save(state, directory, strategy))
            return
        with saver.own_results_queue():
            requests.append(dist_checkpointing.save(state, directory, strategy, async_sharded_save=True))

    write(_model_state(model), _mkdir(path, "model"))
    sharding = None
    if optimizer is not None:
        sharding = _sharding_type(optimizer, fully_reshardable)
        init_optimizer_state(optimizer)  # fix 1 (optimizer.py)
        state = optimizer.sharded_state_dict(_model_state(model), is_loading=False,
                                             metadata=_sharding_metadata(sharding))
        write(state, _mkdir(path, "optimizer"))
        _write_json(os.path.join(_mkdir(path, "rng"), f"rank_{rank:05d}.json"), rng)
        if rank == 0:
            scheduler_state = scheduler.state_dict() if scheduler is not None else None
            _write_json(os.path.join(path, TRAINING_STATE), {"iteration": iteration, "scheduler": scheduler_state,
                                                             "extra_state": json.loads(extra_json)})
    info = {"iteration": iteration, "format": "torch_dist", "model_signature": model_signature(models),
            "parallel": parallel_layout(models, optimizer), "training_state": optimizer is not None,
            "optimizer_sharding": sharding, "lora": adapters, **(metadata or {})}
    if remote:
        def manifest(files: list[FileEntry]) -> Manifest:
            return Manifest(kind=CHECKPOINT_KIND, config_hash=config_hash, files=files, metadata=info,
                            producer=producer_info(stage="checkpoint"))

        def commit_remote() -> Manifest:
            committed = commit_from_nodes(path, target, storage_options, manifest)
            logger.info("committed checkpoint %s from every node's files", target)
            if keep and rank == 0:
                prune_checkpoints(remote, keep, storage_options)
            return committed

        if saver is not None:
            saver.schedule(target, requests, commit_remote, background=False)
            return None
        _barrier()
        return commit_remote()

    def commit_local() -> Manifest:
        manifest = commit_directory(path, CHECKPOINT_KIND, config_hash=config_hash,
                                    producer=producer_info(stage="checkpoint"), metadata=info)
        logger.info("committed checkpoint %s (%s)", path, "training state" if optimizer is not None else "model")
        if keep:
            prune_checkpoints(save, keep)
        return manifest

    if saver is not None:
        saver.schedule(path, requests, commit_local, background=True)
        return None
    _barrier()
    if rank == 0:
        commit_local()
    _barrier()
    return read_manifest(path)


def prune_checkpoints(save: str, keep: int, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Delete all but the newest `keep` committed `iter_*` checkpoints under `save` (a local path or URL),
    and the uncommitted leftovers older than the newest committed one; never the newest committed one, nor
    anything newer than it (a save still being written). Returns what it deleted."""
    if keep < 1:
        raise ConfigError(f"keep_checkpoints is {keep}: keep at least the newest checkpoint (>= 1), or leave it "
                          "unset to keep every checkpoint")
    fs, root = open_fs(save, storage_options)
    if not fs.exists(root):
        return []
    iterations = sorted((int(m.group(1)), name) for entry in fs.ls(root, detail=False)
                        if (m := _ITER.match(name := entry.rstrip("/").rsplit("/", 1)[-1])))
    committed = [(i, name) for i, name in iterations if is_committed(join_uri(save, name), storage_options)]
    if not committed:
        return []
    kept = {name for _, name in committed[-keep:]}
    newest = committed[-1][0]
    doomed = [name for i, name in iterations if i < newest and name not in kept]
    for name in doomed:
        fs.rm(join_uri(root, name), recursive=True)
    if doomed:
        logger.info("pruned %d checkpoint(s) under %s (keep_checkpoints %d): %s", len(doomed), save, keep,
                    ", ".join(doomed))
    return [join_uri(save, name) for name in doomed]


def save_model_checkpoint(models: list[torch.nn.Module], save: str, iteration: int, *,
                          metadata: dict[str, Any], config_hash: str | None = None) -> Manifest:
    """Write the model only (conversion output, `--no-save-optim`) and commit the checkpoint."""
    return save_checkpoint(models, save, iteration, metadata=metadata, config_hash=config_hash)


# ----------------------------------------------------------------------------- load


def read_checkpoint_manifest(path: str) -> Manifest:
    """The manifest of a committed checkpoint, with every listed file present at its recorded size."""
    try:
        manifest = read_manifest(path)
    except NotCommittedError as exc:
        raise UncommittedCheckpointError(f"{exc}; pass a committed iter_* directory or a --save root that "
                                         "holds one") from None
    if manifest.kind != CHECKPOINT_KIND:
        raise CheckpointError(f"{path} is a committed {manifest.kind!r}, not a checkpoint")
    for entry in manifest.files:
        where = os.path.join(path, entry.path)
        if not os.path.isfile(where) or os.path.getsize(where) != entry.bytes:
            raise CorruptArtifactError(f"{where}: missing or not the {entry.bytes} bytes its manifest lists")
    return manifest


def read_training_state(path: str) -> TrainingState:
    """The iteration and `extra_state` of a full training-state checkpoint, without loading any tensor
    (a caller can check them before it commits to a resume)."""
    manifest = read_checkpoint_manifest(path)
    if not manifest.metadata.get("training_state"):
        raise ModelOnlyCheckpointError(f"{path} holds the model only (saved with --no-save-optim, or a "
                                       "conversion): it has no training state to resume")
    with open(os.path.join(path, TRAINING_STATE)) as f:
        training = json.load(f)
    return TrainingState(iteration=int(training["iteration"]), extra_state=training.get("extra_state") or {},
                         manifest=manifest)


def load_model_checkpoint(models: list[torch.nn.Module], path: str) -> Manifest | None:
    """Load a committed checkpoint's model weights into `models` (same architecture and dtype; any
    parallel layout, torch_dist reshards). For conversion output, `--ref-load` and export. A Megatron-LM
    checkpoint's iteration directory loads the same way (megatron_lm.py); it has no manifest: None."""

    if megatron_lm.is_megatron_lm_checkpoint(path):
        megatron_lm.load_megatron_lm_model(models, path)
        return None
    manifest = read_checkpoint_manifest(path)
    signature = model_signature(models)
    if not manifest.metadata.get("lora"):  # a full model's weights are a LoRA model's base
        signature.pop("lora")
    _check(manifest.metadata.get("model_signature"), signature, path)
    _load_model(models, path)
    return manifest


def load_checkpoint(models: list[torch.nn.Module], path: str, optimizer: Any, scheduler: Any = None, *,
                    load_optim: bool = True, load_rng: bool = True) -> TrainingState:
    """Restore the full training state saved by `save_checkpoint` (a collective call): weights,
    optimizer, scheduler, this rank's RNG. Returns the iteration and the caller's `extra_state`.

    Megatron's --no-load-optim (`load_optim=False`): the optimizer and scheduler stay as built (fresh; the
    optimizer's main params are refreshed from the loaded weights), as Megatron-LM loads the scheduler only
    with the optimizer. --no-load-rng (`load_rng=False`): the generators keep their current state. The
    schedule check applies only when the scheduler is loaded, the layout check when per-rank state is.

    A Megatron-LM / slime checkpoint (megatron_lm.py) restores what carries over from it: the weights always, the
    optimizer and schedule where the layouts agree, the RNG where TP and PP do, slime's data cursor when present."""
    from megatron.core import dist_checkpointing


    if megatron_lm.is_megatron_lm_checkpoint(path):
        return megatron_lm.load_megatron_lm_checkpoint(models, path, optimizer, scheduler, load_optim=load_optim,
                                                       load_rng=load_rng)
    manifest = read_checkpoint_manifest(path)
    meta = manifest.metadata
    if not meta.get("training_state"):
        raise ModelOnlyCheckpointError(
            f"{path} holds the model only (saved with --no-save-optim, or a conversion): it cannot resume "
            "training with its optimizer, schedule and RNG. Load it model-only (--load of a new --save "
            "directory, or --ref-load), or resume from a checkpoint saved without --no-save-optim")
    _check(meta.get("model_signature"), model_signature(models), path)
    if load_optim or load_rng:  # both are saved per rank (optimizer shards, RNG files)
        _check(meta.get("parallel"), parallel_layout(models, optimizer), path)
    with open(os.path.join(path, TRAINING_STATE)) as f:
        training = json.load(f)
    if scheduler is not None and load_optim:
        check_scheduler(training.get("scheduler"), scheduler.state_dict(), path)
    rng = None
    if load_rng:
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.path.join(path, "rng", f"rank_{rank:05d}.json")) as f:
            rng = json.load(f)

    _load_model(models, path)
    if load_optim:
        model = single_chunk(models)
        init_optimizer_state(optimizer)  # fix 1: megatron's load path builds a state dict of the current state
        state = optimizer.sharded_state_dict(_model_state(model), is_loading=True,
                                             metadata=_sharding_metadata(meta.get("optimizer_sharding")))
        loaded = dist_checkpointing.load(state, os.path.join(path, "optimizer"))
        restore_zero_steps(loaded)  # fix 4: saved before its first step
        optimizer.load_state_dict(loaded)
        init_optimizer_state(optimizer)  # a state saved before the first step has no `step` (megatron drops a 0)
        untie_adam_steps(optimizer)  # fix 3
        if scheduler is not None and training.get("scheduler") is not None:
            scheduler.load_state_dict(training["scheduler"])
    else:
        # bf16/fp16: the fresh optimizer's fp32 main params were copied from the weights at build time; without
        # this its first step would write those back over the loaded model
        optimizer.reload_model_params()
    if rng is not None:
        restore_rng_state(rng)
    logger.info("resumed training state of %s (iteration %d)%s%s", path, training["iteration"],
                "" if load_optim else ", fresh optimizer and schedule (--no-load-optim)",
                "" if load_rng else ", RNG not restored (--no-load-rng)")
    return TrainingState(iteration=int(training["iteration"]), extra_state=training.get("extra_state") or {},
                         manifest=manifest)


# ----------------------------------------------------------------------------- signatures


def model_signature(models: list[torch.nn.Module]) -> dict[str, Any]:
    """Architecture and dtype of the model: what a checkpoint must share with the model it loads into."""
    from megatron.core.utils import get_model_config

    config = get_model_config(models[0])
    model = single_chunk(models)
    signature = {name: getattr(config, name, None) for name in ARCHITECTURE_FIELDS}
    signature["padded_vocab_size"] = getattr(model, "vocab_size", None)
    signature["share_embeddings_and_output_weights"] = getattr(model, "share_embeddings_and_output_weights", None)
    signature["params_dtype"] = str(config.params_dtype).removeprefix("torch.")
    spec = lora.spec_of(model)
    signature["lora"] = spec.signature() if spec else None
    return signature


def parallel_layout(models: list[torch.nn.Module], optimizer: Any = None) -> dict[str, Any]:
    """How the training state is split over ranks: a full resume needs the same layout."""
    from megatron.core import parallel_state

    return {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": parallel_state.get_data_parallel_world_size(),
            "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
            "use_distributed_optimizer": optimizer is not None and is_distributed_optimizer(optimizer)}


def _check(saved: dict[str, Any] | None, current: dict[str, Any], path: str) -> None:
    if saved is None:  # checkpoints written before signatures were recorded
        logger.warning("%s records no model signature: architecture not checked", path)
        return
    for name, value in current.items():
        if name in saved and saved[name] != value:
            raise CheckpointMismatchError(f"{path}: {name} is {saved[name]!r} in the checkpoint but {value!r} in the "
                                          "model loading it; build the model with the checkpoint's configuration")


# ----------------------------------------------------------------------------- helpers


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of the model: every weight, or with LoRA the adapters only (the base is
    recorded by its content hash, `lora.set_base`)."""
    return lora.adapter_sharded_state_dict(model) if lora.has_adapters(model) else model.sharded_state_dict()


def _load_model(models: list[torch.nn.Module], path: str) -> None:
    """The checkpoint's weights into `models`: a full model's (into a LoRA model: its base, adapters left as
    they are), or a LoRA checkpoint's adapters (onto the same base, checked by hash)."""
    from megatron.core import dist_checkpointing

    model = single_chunk(models)
    saved_lora = read_manifest(path).metadata.get("lora")
    if saved_lora:
        lora.check_base(model, saved_lora.get("base"), path)
        state = dist_checkpointing.load(lora.adapter_sharded_state_dict(model), os.path.join(path, "model"))
        with torch.no_grad():
            for name, value in state.items():
                model.get_parameter(name).copy_(value)
        return
    adapted = lora.has_adapters(model)
    sharded = {k: v for k, v in model.sharded_state_dict().items() if not (adapted and lora.is_adapter_name(k))}
    state = dist_checkpointing.load(sharded, os.path.join(path, "model"))
    result = model.load_state_dict(state, strict=not adapted)
    if adapted and (result.unexpected_keys or any(not lora.is_adapter_name(k) and not k.endswith("_extra_state")
                                                  for k in result.missing_keys)):
        raise CheckpointMismatchError(f"{path}: its weights do not fit the model's base: missing "
                                      f"{result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}")


def _sharding_type(optimizer: Any, fully_reshardable: bool) -> str | None:
    if not is_distributed_optimizer(optimizer):
        return None
    return "fully_reshardable" if fully_reshardable else "dp_reshardable"


def _sharding_metadata(sharding: str | None) -> dict[str, Any] | None:
    # megatron's default for the DistributedOptimizer, 'fully_sharded_model_space', fails in 0.16.1
    return {"distrib_optim_sharding_type": sharding} if sharding else None


def _mkdir(path: str, name: str) -> str:
    os.makedirs(os.path.join(path, name), exist_ok=True)
    return os.path.join(path, name)


def _write_json(path: str, payload: Any) -> None:
    with open(path, "w") as f:
        json.dump(payload, f)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
