"""Stage `evaluate`: multi-dataset eval (pass@k, mean reward, response length) of any stored checkpoint.

    slime evaluate --config deployments/tiny-cpu.yaml --load runs/tiny-cpu/sft/checkpoint
    slime evaluate --config deployments/tiny-cpu.yaml --eval-watch-run tiny-cpu      # for a schedule
    python -m slime.stages.evaluate --config deployments/tiny-cpu.yaml

The policy is `checkpoint.load` (a Megatron checkpoint, or a `--save` root: its newest committed
iteration; an HF directory works too), else `checkpoint.hf_checkpoint`. With `eval_watch_run` it is the
newest committed checkpoint of that run instead (`{store}/{run}/{stage}/checkpoint`, stages in
`eval_watch_stages` order). A Megatron checkpoint is exported to HF in a temporary directory, served by
`eval_num_engines` engines behind sglang-router (`slime.engines.fleet`), and every eval dataset
(`eval_prompt_data` / `eval_config`, see `slime.rollout.eval`) is run once by the eval rollout.

Output, under `{store}/{run_id}/evaluate/{label}-{key10}/`: one shard set per dataset (every sample with
its reward) and `summary.json`, committed together by one manifest written last that names the
evaluated checkpoint and its manifest hash. `label` is the checkpoint's directory name (with its stage
when it lives in a stage's `checkpoint/` root, e.g. `sft-iter_0000003`); `key10` starts the eval key:
the hash of the checkpoint's content (its manifest hash) and of every setting the result depends on
(eval datasets as parsed, eval/rollout/reward/data/engine sections, SGLang flags, seed). Evaluating the
same checkpoint with the same settings again returns the committed result without generating anything;
other settings land in a directory of their own, so results of several eval configs sit side by side.
With `eval_watch_run` an already evaluated checkpoint, or a run with no committed checkpoint yet, is
skipped: `{"skipped": true, "reason": ...}`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime.config import Config, stable_hash
from slime.engines.fleet import serve_policy
from slime.errors import ConfigError, NotCommittedError
from slime.rollout import generate_rollout, rollout_args
from slime.rollout.eval import EvalDatasetConfig, eval_datasets, load_dataset
from slime.rollout.rewards import check_reward_config
from slime.stages.export import policy_hf_dir
from slime.storage import (
    ArtifactStore,
    commit_directory,
    is_committed,
    manifest_hash,
    reusable_manifest,
    write_samples,
)
from slime.storage.fs import is_hf_dir, join_uri, open_fs
from slime.storage.manifest import producer_info
from slime.storage.staging import is_remote, newest_committed

logger = logging.getLogger(__name__)

STAGE = "evaluate"
SUMMARY_NAME = "summary.json"
# eval fields that pick the checkpoint or schedule evals, not what an eval computes
_NOT_IN_KEY = ("eval_interval", "skip_eval_before_train", "eval_watch_run", "eval_watch_stages", "eval_config",
               "eval_prompt_data")


# ----------------------------------------------------------------------------- which policy


def newest_run_checkpoint(config: Config, run_id: str) -> str | None:
    """The newest committed checkpoint of the first of `eval_watch_stages` that has one in `run_id`."""
    store = ArtifactStore.from_config(config)
    for stage in config.eval.eval_watch_stages:
        found = newest_committed(store.uri(run_id, stage, "checkpoint"), store.storage_options)
        if found is not None:
            return found
    return None


def policy_identity(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """Content hash of a policy: its manifest hash when committed (checkpoints, exports), else, for a plain
    HF directory, the hash of config.json and of every file's name, size and modification time (hashing
    the weights themselves would cost a full read of the model on every scheduled run)."""
    if is_remote(path) or is_committed(path):  # in a remote store only committed artifacts are read
        return manifest_hash(path, storage_options)
    listing = []
    for folder, _, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            stat = os.stat(full)
            listing.append((os.path.relpath(full, path), stat.st_size, stat.st_mtime_ns))
    config_json = Path(path, "config.json").read_bytes()
    return stable_hash({"config.json": hashlib.sha256(config_json).hexdigest(), "files": sorted(listing)})


def policy_label(path: str) -> str:
    """A store-safe directory label: `iter_0000003`, `sft-iter_0000003` inside a stage's checkpoint root."""
    path = os.path.normpath(path)
    name = os.path.basename(path)
    parent = os.path.dirname(path)
    if os.path.basename(parent) == "checkpoint":
        name = f"{os.path.basename(os.path.dirname(parent))}-{name}"
    return re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-") or "model"


# ----------------------------------------------------------------------------- eval settings


def eval_settings(config: Config, datasets: list[EvalDatasetConfig]) -> dict[str, Any]:
    """Everything an eval result depends on besides the policy (the eval key is their hash with it)."""
    eval_fields = {k: v for k, v in config.eval.model_dump(mode="json").items() if k not in _NOT_IN_KEY}
    engine = config.engine.model_dump(mode="json", exclude={"sglang_router_ip", "sglang_router_port", "engine_host"})
    return {
        "datasets": [d.model_dump(mode="json") for d in datasets],
        "eval": eval_fields,
        "rollout": config.rollout.model_dump(mode="json"),
        "reward": config.reward.model_dump(mode="json"),
        "data": config.data.model_dump(mode="json"),
        "engine": engine,
        "sglang": config.sglang,
        "seed": config.run.seed,
    }


def check_datasets(args: Any) -> list[EvalDatasetConfig]:
    """Parse and read every eval dataset before any export or engine start; errors name the dataset and
    the file (and line, for a malformed record)."""
    datasets = eval_datasets(args)
    plain = copy.copy(args)
    plain.apply_chat_template = False  # the tokenizer is the served model's; templates are checked at eval
    for ds in datasets:
        try:
            load_dataset(plain, ds)
        except FileNotFoundError as e:
            raise ConfigError(f"eval dataset {ds.name!r}: {ds.path}: no such file ({e})") from None
    return datasets


# ----------------------------------------------------------------------------- results


def _result(meta: dict[str, Any], uri: str, result_hash: str, started: float, reused: bool) -> dict[str, Any]:
    return {"skipped": False, "reused": reused, "result": uri, "summary": join_uri(uri, SUMMARY_NAME),
            "manifest_hash": result_hash, "checkpoint": meta["checkpoint"],
            "checkpoint_manifest_hash": meta["checkpoint_manifest_hash"],
            "checkpoint_rollout_id": meta.get("checkpoint_rollout_id"),
            "checkpoint_weight_version": meta.get("checkpoint_weight_version"),
            "datasets": {name: join_uri(uri, name) for name in meta["metrics"]},
            "metrics": meta["metrics"], "eval_seconds": meta["eval_seconds"],
            "seconds": time.perf_counter() - started}


def policy_step(source: str) -> dict[str, int | None]:
    """The RL step a checkpoint of the RL loop holds: the rollout id it was saved after and the weight version
    of its weights (its training state's extra state), so a scheduled eval of a running run is keyed as the
    loop's own evals are; None for anything else (an HF directory, a conversion, a remote checkpoint: the
    result is keyed by the checkpoint alone)."""
    path = os.path.join(source, "training_state.json")  # slime.backends.megatron.checkpoint.TRAINING_STATE
    if is_remote(source) or not os.path.isfile(path):
        return {"checkpoint_rollout_id": None, "checkpoint_weight_version": None}
    with open(path) as f:
        extra = json.load(f).get("extra_state") or {}
    return {"checkpoint_rollout_id": extra.get("rollout_id"), "checkpoint_weight_version": extra.get("weight_version")}


def split_metrics(metrics: dict[str, Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """{dataset: {metric: value}} from the eval rollout's flat `eval/<dataset>/<metric>` figures."""
    return {name: {k.removeprefix(f"eval/{name}/"): v for k, v in metrics.items() if k.startswith(f"eval/{name}/")}
            for name in names}


def write_result(store: ArtifactStore, uri: str, key: str, out: Any, meta: dict[str, Any], run_id: str) -> None:
    """Dataset shard sets, then summary.json, then the manifest over all of it (written last)."""
    fs, root = open_fs(uri, store.storage_options)
    if fs.exists(root):  # an earlier attempt with this key died before its commit: nothing in it counts
        logger.warning("removing the uncommitted leftovers of an earlier eval at %s", uri)
        fs.rm(root, recursive=True)
    producer = {"run_id": run_id, "stage": STAGE}
    for name, data in out.data.items():
        write_samples(join_uri(uri, name), data["samples"], config_hash=key, producer=producer,
                      metadata={"dataset": name, "summary": meta["metrics"][name], "checkpoint": meta["checkpoint"]},
                      storage_options=store.storage_options)
    fs.pipe_file(join_uri(root, SUMMARY_NAME), json.dumps(meta, indent=2, sort_keys=True).encode())
    commit_directory(uri, "eval_result", config_hash=key, producer=producer_info(**producer), metadata=meta,
                     storage_options=store.storage_options)


# ----------------------------------------------------------------------------- stage


@dataclass
class EvalPlan:
    """What `run_evaluate` would do, decided without serving anything: the policy (`source`, None when a
    watched run has no checkpoint yet, with `reason`), its content hash, the settings, the eval key and
    the result directory. A Prefect task can use `uri` to say where the result lands."""

    datasets: list[EvalDatasetConfig]
    source: str | None = None
    reason: str | None = None
    policy_hash: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    key: str | None = None
    uri: str | None = None


def _policy_source(config: Config) -> str:
    """`checkpoint.load` (HF dir, checkpoint, or save root -> newest committed iteration), else `hf_checkpoint`."""
    from slime.backends.megatron.checkpoint import resolve_checkpoint

    load, hf = config.checkpoint.load, config.checkpoint.hf_checkpoint
    if load and is_remote(load):  # a checkpoint, save root or export in the store
        found = newest_committed(load, config.run.storage_options)
        if found is None:
            raise NotCommittedError(f"checkpoint.load: {load} holds no committed checkpoint (no iter_*/manifest.json)")
        return found
    if load:
        return load if is_hf_dir(load) else resolve_checkpoint(load)
    if hf:
        if not is_hf_dir(hf):
            raise ConfigError(f"checkpoint.hf_checkpoint {hf}: not an HF model directory (no config.json)")
        return hf
    raise ConfigError("evaluate needs a policy: --load (Megatron checkpoint, save root or HF dir), "
                      "--hf-checkpoint, or --eval-watch-run RUN")


def plan_evaluate(config: Config) -> EvalPlan:
    """Check the datasets and reward settings, pick the policy, compute the eval key and result URI."""
    config.require("run.run_id", stage=STAGE)
    args = config.as_namespace()
    plan = EvalPlan(datasets=check_datasets(args))
    check_reward_config(args)
    watch = config.eval.eval_watch_run
    if watch:
        plan.source = newest_run_checkpoint(config, watch)
        if plan.source is None:
            stages = ", ".join(config.eval.eval_watch_stages)
            plan.reason = f"run {watch!r} has no committed checkpoint yet (searched {stages} in {config.run.store})"
            return plan
    else:
        plan.source = _policy_source(config)
    plan.policy_hash = policy_identity(plan.source, config.run.storage_options)
    plan.settings = eval_settings(config, plan.datasets)
    plan.key = stable_hash({"policy": plan.policy_hash, "settings": plan.settings})
    plan.uri = ArtifactStore.from_config(config).uri(config.run.run_id, STAGE,
                                                     f"{policy_label(plan.source)}-{plan.key[:10]}")
    return plan


def run_evaluate(config: Config) -> dict[str, Any]:
    """Evaluate one checkpoint on every eval dataset (or reuse the committed result); see the module docstring.

    Returns JSON-ready values: `metrics` ({dataset: {mean_reward, pass@k, truncated_ratio, response_len/...}}),
    `result` / `summary` / `datasets` URIs, `manifest_hash` of the result, the evaluated `checkpoint` and its
    `checkpoint_manifest_hash`, `reused`, `skipped` (watch mode), `seconds` (and `phases` when it ran).
    """
    started = time.perf_counter()
    plan = plan_evaluate(config)
    if plan.uri is None:
        logger.info("evaluate: skipping: %s", plan.reason)
        return {"skipped": True, "reason": plan.reason, "seconds": time.perf_counter() - started}
    source, uri, key, settings, datasets = plan.source, plan.uri, plan.key, plan.settings, plan.datasets
    store = ArtifactStore.from_config(config)
    manifest = reusable_manifest(uri, key, "{uri} holds an eval with another key ({found}); remove it or "
                                 "use another run_id", store.storage_options)
    if manifest is not None:
        result = _result(manifest.metadata, uri, manifest_hash(uri, store.storage_options), started, reused=True)
        if config.eval.eval_watch_run:
            reason = f"{source} was evaluated with this config already: {uri}"
            logger.info("evaluate: skipping: %s", reason)
            return {**result, "skipped": True, "reason": reason}
        logger.info("evaluate: %s is committed already: reusing it", uri)
        return result

    phases: dict[str, float] = {}
    # engine and router logs under {store}/{run_id}/evaluate/logs (a temporary directory on a remote store)
    logs = store.local_dir(config.run.run_id, STAGE, "logs") if config.run.run_id else None
    with tempfile.TemporaryDirectory(prefix="slime-evaluate-") as tmp:
        mark = time.perf_counter()
        model_dir = policy_hf_dir(config, source, os.path.join(tmp, "policy-hf"))
        phases["export_s"], mark = time.perf_counter() - mark, time.perf_counter()
        with serve_policy(config, model_dir, Path(logs or tmp), config.eval.eval_num_engines) as router:
            phases["engines_s"], mark = time.perf_counter() - mark, time.perf_counter()
            eval_args = rollout_args(config, router)
            eval_args.hf_checkpoint = model_dir  # prompts are encoded with the served model's tokenizer
            eval_args.run_id = None  # the eval rollout's own store layout is the RL loop's; ours is below
            out = generate_rollout(eval_args, 0, None, evaluation=True)
            phases["eval_s"] = time.perf_counter() - mark
    names = [ds.name for ds in datasets]
    meta = {"checkpoint": source, "checkpoint_manifest_hash": plan.policy_hash, **policy_step(source),
            "metrics": split_metrics(out.metrics, names), "eval_seconds": phases["eval_s"], "settings": settings,
            "eval_key": key}
    mark = time.perf_counter()
    write_result(store, uri, key, out, meta, config.run.run_id)
    phases["commit_s"] = time.perf_counter() - mark
    for name in names:
        logger.info("evaluate %s on %s: %s", source, name, meta["metrics"][name])
    return {**_result(meta, uri, manifest_hash(uri, store.storage_options), started, reused=False), "phases": phases}


if __name__ == "__main__":
    from slime.cli import main

    sys.exit(main(["evaluate", *sys.argv[1:]]))
