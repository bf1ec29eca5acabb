"""Stage `rejection_sampling`: sample N responses per prompt from a policy, score them, keep the accepted
ones as an SFT shard set.

    slime rejection-sample --config deployments/tiny-cpu.yaml --rs-policy runs/exp/export/hf \\
        --n-samples-per-prompt 8 --rs-reward-threshold 1 --rs-best-of-n 2
    python -m slime.stages.rejection_sampling --config deployments/tiny-cpu.yaml

slime has no such stage (its recipe is `--debug-rollout-only --save-debug-rollout-data`, then a filter
on `reward`); this one does both steps and records what it threw away. The policy (`rs_policy`, else
`checkpoint.load`, else `checkpoint.hf_checkpoint`) is an HF directory or a Megatron checkpoint, which
is exported to HF first (once, under the stage's directory). It is served by `rs_num_engines` engines
behind sglang-router; every prompt is sent `n_samples_per_prompt` times with the rollout sampling
settings, and the responses are scored by the reward hub (`slime.rollout.rewards`).

Acceptance, per prompt: only finished responses (COMPLETED; TRUNCATED too with `rs_keep_truncated`)
with reward >= `rs_reward_threshold`; identical responses once (`rs_dedup`); at most the
`rs_best_of_n` best (ties keep sampling order). Two shard sets are committed under
`{store}/{run_id}/rejection_sampling/`: `{rs_output_name}` (accepted samples; loss mask over the
response, readable by `slime sft --sft-data URI`) and `{rs_output_name}-candidates` (every sample with
its reward and status, so nothing is lost). The acceptance statistics are in both manifests'
metadata and in the returned summary. A committed output with the same config is reused, not redone.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from slime.config import Config
from slime.engines.client import EngineClient
from slime.engines.fleet import serve_policy
from slime.errors import ConfigError, EngineError
from slime.rollout.http import rollout_client
from slime.rollout.rewards import check_reward_config, reward_samples
from slime.stages.export import policy_hf_dir
from slime.types import Sample, Status

logger = logging.getLogger(__name__)

STAGE = "rejection_sampling"
_REJECT_REASONS = ("rejected_truncated", "rejected_aborted", "rejected_failed", "rejected_empty",
                   "rejected_threshold", "rejected_duplicate", "rejected_best_of_n")


# ----------------------------------------------------------------------------- acceptance


def select_accepted(args: Any, groups: list[list[Sample]], *, threshold: float | None, best_of_n: int | None,
                    dedup: bool, keep_truncated: bool) -> tuple[list[Sample], dict[str, Any]]:
    """Accepted samples of every group (best first within a group) and the counts of why others were not.

    Every sample is counted exactly once: `samples == accepted + sum(rejected_*)`.
    """
    counts: Counter[str] = Counter({reason: 0 for reason in _REJECT_REASONS})
    accepted: list[Sample] = []
    rewards: list[float] = []
    prompts_with_accepted = 0
    finished = {Status.COMPLETED, Status.TRUNCATED} if keep_truncated else {Status.COMPLETED}
    for group in groups:
        scored: list[tuple[float, Sample]] = []
        for sample in group:
            if sample.status not in finished:
                reason = "failed" if sample.status in (Status.FAILED, Status.PENDING) else sample.status.value
                counts[f"rejected_{reason}"] += 1
                continue
            value = sample.get_reward_value(args)
            rewards.append(value)
            if sample.response_length == 0:
                counts["rejected_empty"] += 1
            elif threshold is not None and value < threshold:
                counts["rejected_threshold"] += 1
            else:
                scored.append((value, sample))
        scored.sort(key=lambda pair: -pair[0])  # stable: equal rewards keep sampling order
        kept: list[Sample] = []
        seen: set[tuple[int, ...]] = set()
        for _, sample in scored:
            response_ids = tuple(sample.tokens[len(sample.tokens) - sample.response_length :])
            if dedup and response_ids in seen:
                counts["rejected_duplicate"] += 1
            elif best_of_n is not None and len(kept) >= best_of_n:
                counts["rejected_best_of_n"] += 1
            else:
                seen.add(response_ids)
                kept.append(sample)
        prompts_with_accepted += bool(kept)
        accepted.extend(kept)
    total = sum(len(g) for g in groups)
    stats = {
        "prompts": len(groups),
        "samples": total,
        "accepted": len(accepted),
        "acceptance_rate": len(accepted) / total if total else 0.0,
        "prompts_with_accepted": prompts_with_accepted,
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        **{reason: counts[reason] for reason in _REJECT_REASONS},
    }
    return accepted, stats


# ----------------------------------------------------------------------------- generation


def sampling_params(config: Config) -> dict[str, Any]:
    """SGLang sampling params from the rollout settings (slime's names), without unset ones."""
    r = config.rollout
    params = {"temperature": r.rollout_temperature, "top_p": r.rollout_top_p, "top_k": r.rollout_top_k,
              "max_new_tokens": r.rollout_max_response_len, "stop": r.rollout_stop,
              "stop_token_ids": r.rollout_stop_token_ids, "skip_special_tokens": r.rollout_skip_special_tokens,
              "no_stop_trim": True, "spaces_between_special_tokens": False}
    return {k: v for k, v in params.items() if v is not None}


def _fill(args: Any, sample: Sample, prompt_ids: list[int], output: dict[str, Any]) -> None:
    output_ids = list(output.get("output_ids") or [])
    sample.tokens = prompt_ids + output_ids
    sample.response = output.get("text", "")
    sample.response_length = len(output_ids)
    sample.loss_mask = [1] * len(output_ids)
    sample.update_from_meta_info(args, output.get("meta_info") or {})
    if sample.status is Status.PENDING:  # no finish_reason: the engine's answer is incomplete
        sample.status = Status.FAILED
        sample.metadata["generate_error"] = "engine reply has no meta_info.finish_reason"


async def generate_and_score(args: Any, router_url: str, prompts: list[Sample], prompt_ids: list[list[int]],
                             n: int, params: dict[str, Any], concurrency: int) -> list[list[Sample]]:
    """`n` samples per prompt through the router (at most `concurrency` in flight), then rewards.

    An engine error fails that sample (`metadata["generate_error"]`), not the stage.
    """
    semaphore = asyncio.Semaphore(concurrency)
    groups = [[Sample(group_index=p.group_index, index=p.index * n + j, prompt=p.prompt, label=p.label,
                      metadata={**p.metadata}) for j in range(n)] for p in prompts]

    async def one(client: EngineClient, sample: Sample, ids: list[int]) -> None:
        async with semaphore:
            try:
                output = await client.post(f"{router_url}/generate",
                                           json={"input_ids": ids, "sampling_params": params})
            except EngineError as exc:
                sample.status = Status.FAILED
                sample.metadata["generate_error"] = f"{type(exc).__name__}: {exc}"
                return
        _fill(args, sample, ids, output)

    async with rollout_client(args, max_connections=concurrency) as client:  # rollout_http_timeout_s
        await asyncio.gather(*(one(client, s, ids) for group, ids in zip(groups, prompt_ids, strict=True)
                               for s in group))
    await reward_samples(args, [s for group in groups for s in group if s.status is not Status.FAILED])
    return groups


# ----------------------------------------------------------------------------- policy


def policy_source(config: Config) -> str:
    """The policy to sample from: `rs_policy`, else `checkpoint.load`, else `checkpoint.hf_checkpoint`."""
    source = config.rejection_sampling.rs_policy or config.checkpoint.load or config.checkpoint.hf_checkpoint
    if not source:
        raise ConfigError("rejection_sampling needs a policy: rs_policy (--rs-policy), checkpoint.load or "
                          "checkpoint.hf_checkpoint")
    return source


# ----------------------------------------------------------------------------- stage


def _config_hash(config: Config) -> str:
    return config.section_hash("rejection_sampling", "rollout", "reward", "data", "checkpoint")


def run_rejection_sampling(config: Config) -> dict[str, Any]:
    """Sample, score, select and commit; returns the output URIs and the acceptance statistics."""
    from transformers import AutoTokenizer

    from slime.data.prompts import load_prompts
    from slime.storage import ArtifactStore, reusable_manifest, write_samples

    config.require("run.run_id", stage=STAGE)
    rs, data = config.rejection_sampling, config.data
    prompt_data = rs.rs_prompt_data or data.prompt_data
    if not prompt_data:
        raise ConfigError("rejection_sampling needs prompts: rs_prompt_data (--rs-prompt-data) or data.prompt_data")
    args = config.as_namespace()
    check_reward_config(args)
    store = ArtifactStore.from_config(config)
    out_uri = store.uri(config.run.run_id, STAGE, rs.rs_output_name)
    candidates_uri = store.uri(config.run.run_id, STAGE, f"{rs.rs_output_name}-candidates")
    config_hash = _config_hash(config)
    manifest = reusable_manifest(out_uri, config_hash, "{uri} is already committed by a different "
                                 "rejection-sampling config (or by this project before 2026-11-26, whose config "
                                 "hash covered fields left at their defaults); set another rs_output_name or "
                                 "run_id", store.storage_options)
    if manifest is not None:
        logger.info("rejection sampling output %s is committed already: reusing it", out_uri)
        return {**manifest.metadata["summary"], "output": out_uri, "candidates": candidates_uri, "reused": True}

    model_dir = policy_hf_dir(config, policy_source(config), store.uri(config.run.run_id, STAGE, "policy-hf"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts(prompt_data, input_key=data.input_key, label_key=data.label_key,
                           metadata_key=data.metadata_key, tool_key=data.tool_key, tokenizer=tokenizer,
                           apply_chat_template=data.apply_chat_template,
                           apply_chat_template_kwargs=data.apply_chat_template_kwargs,
                           max_prompt_len=data.rollout_max_prompt_len, storage_options=config.run.storage_options)
    prompt_ids = [tokenizer.encode(p.prompt, add_special_tokens=False) if isinstance(p.prompt, str)
                  else tokenizer.apply_chat_template(p.prompt, tokenize=True, add_generation_prompt=True)
                  for p in prompts]
    n = config.rollout.n_samples_per_prompt
    # engine and router logs under {store}/{run_id}/rejection_sampling/logs (a temporary directory on a remote store)
    logs = store.local_dir(config.run.run_id, STAGE, "logs")
    with (tempfile.TemporaryDirectory(prefix="slime-rs-") as tmp,
          serve_policy(config, model_dir, Path(logs or tmp), rs.rs_num_engines) as router):
        groups = asyncio.run(generate_and_score(args, router.url, prompts, prompt_ids, n, sampling_params(config),
                                                rs.rs_concurrency))
    accepted, stats = select_accepted(args, groups, threshold=rs.rs_reward_threshold, best_of_n=rs.rs_best_of_n,
                                      dedup=rs.rs_dedup, keep_truncated=rs.rs_keep_truncated)
    stats["generate_errors"] = sum("generate_error" in s.metadata for g in groups for s in g)
    stats["reward_errors"] = sum("reward_error" in s.metadata for g in groups for s in g)
    logger.info("rejection sampling: accepted %d of %d samples (%d of %d prompts)", stats["accepted"],
                stats["samples"], stats["prompts_with_accepted"], stats["prompts"])
    metadata = {"summary": stats, "policy": model_dir, "prompt_data": prompt_data}
    common = {"config_hash": config_hash, "storage_options": store.storage_options,
              "producer": {"run_id": config.run.run_id, "stage": STAGE}}
    write_samples(candidates_uri, [s for g in groups for s in g], metadata=metadata, **common)
    write_samples(out_uri, accepted, metadata=metadata, **common)
    return {**stats, "output": out_uri, "candidates": candidates_uri, "reused": False}


if __name__ == "__main__":
    from slime.cli import main

    sys.exit(main(["rejection-sample", *sys.argv[1:]]))
