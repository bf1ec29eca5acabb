"""Eval rollout: several named datasets, `n_samples_per_eval_prompt` samples per prompt, scored and reported.

Datasets come from `eval_prompt_data` (name -> path) or an `eval_config` YAML in slime's format:

    eval:
      defaults: {n_samples_per_eval_prompt: 4, temperature: 0.7}
      datasets:
        - {name: arith, path: data/eval.jsonl, rm_type: math_verify, max_response_len: 16}
        - {name: hard, path: s3://bucket/hard.jsonl, custom_rm_path: my.rm, top_p: 0.9}

Each setting falls back dataset -> `defaults` -> `eval_*` field -> `rollout_*` field (slime's order).
All datasets run concurrently behind one semaphore. Per dataset the report gives the mean reward,
pass@k (unbiased estimator of Chen et al. 2021, a sample counting as correct when its reward > 0) for
k = 1, 2, 4, ... up to n, the truncated ratio, response lengths and failed samples; the samples go to the
store as one shard set per dataset plus a JSON summary (slime.rollout.store).
"""

from __future__ import annotations

import asyncio
import copy
import math
import statistics
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slime.config import resolve_input_path
from slime.data.prompts import load_prompts
from slime.errors import ConfigError
from slime.rollout.generate import sampling_params_from_args, tokenizer_of
from slime.rollout.hooks import check_rollout_plugins, load_generate_function
from slime.rollout.http import engine_client, router_url, worker_urls
from slime.rollout.outputs import RolloutFnEvalOutput, flatten
from slime.rollout.rewards import check_reward_config
from slime.rollout.state import GenerateState, RolloutEngineError, cancel
from slime.rollout.store import check_not_written, write_eval
from slime.types import Sample, Status

_SETTINGS = ("n_samples_per_eval_prompt", "temperature", "top_p", "top_k", "max_response_len", "stop",
             "stop_token_ids", "input_key", "label_key", "metadata_key", "tool_key", "rm_type", "custom_rm_path",
             "custom_generate_function_path", "metadata_overrides")


class EvalDatasetConfig(BaseModel):
    """One eval dataset; unset fields fall back to `defaults`, then the `eval_*`/`rollout_*` flags."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    path: str
    n_samples_per_eval_prompt: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    max_response_len: int | None = Field(None, ge=1)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    input_key: str | None = None
    label_key: str | None = None
    metadata_key: str | None = None
    tool_key: str | None = None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    metadata_overrides: dict[str, Any] = Field(default_factory=dict)

    def setting(self, name: str, args: Any, *fallbacks: str) -> Any:
        value = getattr(self, name)
        for attr in fallbacks:
            if value is not None:
                break
            value = getattr(args, attr, None)
        return value


class _EvalFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    defaults: dict[str, Any] = Field(default_factory=dict)
    datasets: list[dict[str, Any]]


def _parse(raw: dict[str, Any], defaults: dict[str, Any], where: str) -> EvalDatasetConfig:
    merged = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    try:
        return EvalDatasetConfig(**merged)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"{where}: {problems}") from None


def eval_datasets(args: Any) -> list[EvalDatasetConfig]:
    """The eval datasets from `args.eval_config` (YAML) or `args.eval_prompt_data` (name -> path)."""
    config_path = getattr(args, "eval_config", None)
    datasets: list[EvalDatasetConfig] = []
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"eval_config {config_path}: no such file")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"eval_config {config_path}: not valid YAML: {e}") from None
        raw = raw.get("eval", raw) if isinstance(raw, dict) else raw
        try:
            parsed = _EvalFile(**raw) if isinstance(raw, dict) else None
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"eval_config {config_path}: {problems}") from None
        if parsed is None:
            raise ConfigError(f"eval_config {config_path}: expected a mapping with 'datasets' (under 'eval:')")
        unknown = sorted(set(parsed.defaults) - set(_SETTINGS))
        if unknown:
            raise ConfigError(f"eval_config {config_path}: eval.defaults has unknown field(s) {unknown}; "
                              f"known: {list(_SETTINGS)}")
        for i, entry in enumerate(parsed.datasets):
            # a dataset path written in the eval_config file is relative to that file, as in the main config
            entry = {**entry, "path": resolve_input_path(entry.get("path"), path.parent)} if "path" in entry else entry
            datasets.append(_parse(entry, parsed.defaults, f"eval_config {config_path}: eval.datasets[{i}]"))
    for name, data_path in (getattr(args, "eval_prompt_data", None) or {}).items():
        datasets.append(_parse({"name": name, "path": data_path}, {}, f"eval_prompt_data[{name!r}]"))
    names = [d.name for d in datasets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"eval dataset name(s) {duplicates} given more than once")
    if not datasets:
        raise ConfigError("no eval dataset: set eval_prompt_data (--eval-prompt-data name path ...) or eval_config")
    return datasets


def dataset_args(args: Any, ds: EvalDatasetConfig) -> Any:
    """`args` as the dataset's plugins see it: its reward settings and sampling overrides applied, and
    `rollout_max_context_len` set to the eval bound (`eval_max_context_len`, default the rollout's, as in
    slime), which is what the requests of an eval sample obey (slime.rollout.multiturn.response_limit)."""
    out = copy.copy(args)
    eval_context = getattr(args, "eval_max_context_len", None)
    if eval_context is not None:
        out.rollout_max_context_len = eval_context
    if ds.custom_rm_path:
        out.custom_rm_path = ds.custom_rm_path
    for field, attr in (("temperature", "eval_temperature"), ("top_p", "eval_top_p"), ("top_k", "eval_top_k"),
                        ("max_response_len", "eval_max_response_len")):
        if getattr(ds, field) is not None:
            setattr(out, attr, getattr(ds, field))
    return out


def dataset_sampling_params(args: Any, ds: EvalDatasetConfig) -> dict[str, Any]:
    params = sampling_params_from_args(dataset_args(args, ds), evaluation=True)
    if ds.stop is not None:
        params["stop"] = ds.stop
    if ds.stop_token_ids is not None:
        params["stop_token_ids"] = ds.stop_token_ids
    return params


def load_dataset(args: Any, ds: EvalDatasetConfig) -> list[Sample]:
    """The dataset's prompts (keys: dataset -> eval_* -> data flags), with its metadata overrides."""
    apply_template = bool(getattr(args, "apply_chat_template", False))
    prompts = load_prompts(
        ds.path,
        input_key=ds.setting("input_key", args, "eval_input_key", "input_key") or "prompt",
        label_key=ds.setting("label_key", args, "eval_label_key", "label_key"),
        metadata_key=ds.setting("metadata_key", args, "metadata_key"),
        tool_key=ds.setting("tool_key", args, "eval_tool_key", "tool_key"),
        tokenizer=tokenizer_of(args) if apply_template or getattr(args, "eval_max_prompt_len", None) else None,
        max_prompt_len=getattr(args, "eval_max_prompt_len", None),
        apply_chat_template=apply_template,
        apply_chat_template_kwargs=getattr(args, "apply_chat_template_kwargs", None) or None,
        storage_options=getattr(args, "storage_options", None) or None,
    )
    for p in prompts:
        p.metadata = {**(p.metadata or {}), **ds.metadata_overrides}
        if ds.rm_type:
            p.metadata["rm_type"] = ds.rm_type
        p.generate_function_path = ds.custom_generate_function_path or p.generate_function_path
    return prompts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with `c` correct of `n` samples: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(args: Any, groups: list[list[Sample]], n: int) -> dict[str, Any]:
    """The report of one dataset (keys without the `eval/<name>/` prefix)."""
    samples = flatten(groups)
    scored = [s for s in samples if s.status is not Status.FAILED and s.reward is not None]
    scored_ids = {id(s) for s in scored}
    reward_key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)

    def value(s: Sample) -> float:
        return float(s.reward[reward_key] if reward_key and isinstance(s.reward, dict) else s.get_reward_value(args))

    lengths = [s.response_length for s in samples] or [0]
    report: dict[str, Any] = {
        "prompts": len(groups),
        "samples": len(samples),
        "failed": len(samples) - len(scored),
        "mean_reward": statistics.fmean(value(s) for s in scored) if scored else None,
        "truncated_ratio": sum(s.status is Status.TRUNCATED for s in samples) / max(1, len(samples)),
        "response_len/mean": statistics.fmean(lengths),
        "response_len/max": max(lengths),
    }
    k = 1
    while k <= n:
        per_prompt = []
        for group in groups:
            correct = sum(1 for s in flatten(group) if id(s) in scored_ids and value(s) > 0)
            per_prompt.append(pass_at_k(len(flatten(group)), correct, k))
        report[f"pass@{k}"] = statistics.fmean(per_prompt) if per_prompt else None
        k *= 2
    return report


async def eval_rollout(args: Any, rollout_id: int) -> RolloutFnEvalOutput:
    """Run every eval dataset once; see the module docstring."""
    datasets = eval_datasets(args)
    plugins = check_rollout_plugins(args)
    for ds in datasets:  # per-dataset plugins: fail before any generation
        if ds.custom_generate_function_path:
            load_generate_function(ds.custom_generate_function_path)
        check_reward_config(dataset_args(args, ds))
    check_not_written(args, "eval", f"{rollout_id:06d}-summary")
    prompts = {ds.name: load_dataset(args, ds) for ds in datasets}
    client = engine_client(args)
    url = router_url(args)
    urls = await worker_urls(client, url)
    if not urls:
        raise RolloutEngineError(f"router {url} has no worker registered")
    semaphore = asyncio.Semaphore(max(1, args.sglang_server_concurrency * len(urls)))
    started = time.perf_counter()
    tasks: dict[str, list[asyncio.Task]] = {}
    states = []
    for ds in datasets:
        state = GenerateState(dataset_args(args, ds), plugins, len(urls), evaluation=True, semaphore=semaphore,
                              rollout_id=rollout_id)
        states.append(state)
        params = dataset_sampling_params(args, ds)
        n = ds.setting("n_samples_per_eval_prompt", args, "n_samples_per_eval_prompt") or 1
        index = 0
        tasks[ds.name] = []
        for group_index, prompt in enumerate(prompts[ds.name]):
            group = []
            for _ in range(n):
                sample = copy.deepcopy(prompt)
                sample.group_index, sample.index = group_index, index
                index += 1
                group.append(sample)
            tasks[ds.name].append(asyncio.create_task(state.generate_group(group, params)))
    everything = {t for ts in tasks.values() for t in ts}
    try:
        await asyncio.gather(*everything)
    except BaseException:
        await cancel(states[0], {t for t in everything if not t.done()}, urls)
        raise
    elapsed = time.perf_counter() - started
    data: dict[str, dict[str, list[Any]]] = {}
    summary: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    for ds in datasets:
        groups = [t.result() for t in tasks[ds.name]]
        n = ds.setting("n_samples_per_eval_prompt", args, "n_samples_per_eval_prompt") or 1
        summary[ds.name] = summarize(dataset_args(args, ds), groups, n)
        samples = flatten(groups)
        data[ds.name] = {
            "rewards": [s.reward for s in samples],
            "truncated": [s.status is Status.TRUNCATED for s in samples],
            "samples": samples,
        }
        metrics.update({f"eval/{ds.name}/{k}": v for k, v in summary[ds.name].items()})
    metrics["eval/time_s"] = elapsed
    uri = write_eval(args, rollout_id, {name: d["samples"] for name, d in data.items()}, summary)
    if uri:
        metrics["eval/summary_uri"] = uri
    return RolloutFnEvalOutput(data=data, metrics=metrics)
