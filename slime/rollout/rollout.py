"""`generate_rollout`: one rollout step, `rollout_batch_size` scored groups, as slime's sglang_rollout.

How a step runs (slime's `generate_rollout_async`, reimplemented):

1. Set-up: every plugin is loaded and signature-checked and the router's workers are listed, before
   a single prompt is drawn; the semaphore allows `sglang_server_concurrency x engines` requests.
2. Groups of `n_samples_per_prompt` are drawn `over_sampling_batch_size` at a time (the partial-rollout
   buffer first) while kept + in-flight groups are fewer than `rollout_batch_size`. Each group is one
   task: its samples generate concurrently, then the group is rewarded as a unit.
3. As groups finish, the dynamic filter keeps or drops them; dropped groups are replaced by drawing more.
4. Once `rollout_batch_size` groups are kept, every worker gets `/abort_request {"abort_all": true}`
   (repeated until every task has returned and every worker's `/get_load` is 0). With `partial_rollout`
   the unfinished groups, with the tokens they have, go back to the data source's buffer and continue
   in a later step; otherwise they are dropped and counted.
5. Hooks `rollout_sample_filter_path` and `rollout_all_samples_process_path` run, metrics are computed
   and, when `args.run_id` is set, the kept groups are written as the shard set
   `{store}/{run_id}/rollout/{rollout_id:06d}` (dropped samples under `rollout_dropped/`).

Accounting: every group drawn is kept, dropped by the filter, failed, dropped after abort, or returned
to the buffer; the `rollout/groups/*` metrics add up, and a step where they do not raises.

Errors: a request the engine refuses (HTTP 4xx, or 5xx after the client's retries) makes that sample
FAILED with `metadata["generate_error"]`; a reward function that raises makes it FAILED with
`metadata["reward_error"]` (slime.rollout.rewards). A group with a FAILED sample is not trained on and is
counted in `rollout/groups/failed`. When as many groups fail in a row as a step needs
(`max(rollout_batch_size, over_sampling_batch_size)`), the engines are taken to be unusable and
`RolloutEngineError` is raised (after aborting what is in flight) instead of drawing prompts forever.
Departure from slime: groups that finish after the batch is full are returned to the buffer (partial
rollout) or counted as dropped, where slime silently discards them.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import Counter
from typing import Any

from slime.errors import ConfigError, EngineError
from slime.rollout.eval import eval_rollout, pass_at_k
from slime.rollout.filters import call_dynamic_filter, should_drop
from slime.rollout.generate import sampling_params_from_args
from slime.rollout.hooks import check_rollout_plugins
from slime.rollout.http import close_engine_client, engine_client, router_url, worker_urls
from slime.rollout.outputs import RolloutFnTrainOutput, flatten
from slime.rollout.staleness import staleness_metrics
from slime.rollout.state import GenerateState, RolloutEngineError, cancel, drain, first_error_of, group_state
from slime.rollout.store import check_not_written, write_rollout
from slime.types import Sample, Status

logger = logging.getLogger(__name__)

# A step gives up when the dynamic filter drops this many times max(rollout_batch_size,
# over_sampling_batch_size) groups in a row: with a 90% drop rate, 20 x 32 drops in a row has
# probability 0.9**640 ~ 1e-29, so only a filter that never keeps anything gets here.
FILTER_STARVATION_FACTOR = 20


class FilterStarvedError(ConfigError):
    """The dynamic filter drops every group: the step could never fill its batch."""


def _sort_key(group: list[Any]) -> int:
    samples = flatten(group)
    return samples[0].index if samples and samples[0].index is not None else -1


def _reward_value(args: Any, group: list[Any]) -> list[float] | None:
    try:
        return [float(s.get_reward_value(args)) for s in flatten(group)]
    except Exception:
        return None


def rollout_metrics(args: Any, kept: list[list[Any]], counts: Counter, reasons: Counter, elapsed: float,
                    new_tokens: int, trainer_version: int | None = None) -> dict[str, Any]:
    """Flat `rollout/...` metrics of one step (kept samples unless the name says otherwise); with the
    `trainer_version` that will train them, their staleness (`async/staleness/*`, slime.rollout.staleness)."""
    samples = flatten(kept)
    lengths = [s.response_length for s in samples] or [0]
    rewards = [r for g in kept for r in (_reward_value(args, g) or [])]
    metrics: dict[str, Any] = {
        "rollout/response_len/mean": statistics.fmean(lengths),
        "rollout/response_len/max": max(lengths),
        "rollout/truncated_ratio": sum(s.status is Status.TRUNCATED for s in samples) / max(1, len(samples)),
        "rollout/reward/mean": statistics.fmean(rewards) if rewards else None,
        "rollout/samples": len(samples),
        "rollout/new_tokens": new_tokens,
        "rollout/time_s": elapsed,
        "rollout/tokens_per_s": new_tokens / elapsed if elapsed > 0 else 0.0,
        "rollout/samples_per_s": len(samples) / elapsed if elapsed > 0 else 0.0,
    }
    for key in ("drawn", "kept", "filtered", "failed", "aborted_dropped", "to_buffer", "zero_std"):
        metrics[f"rollout/groups/{key}"] = counts[key]
    metrics["rollout/samples/failed"] = counts["failed_samples"]
    metrics["rollout/samples/aborted"] = counts["aborted_samples"]
    for reason, n in reasons.items():
        metrics[f"rollout/dynamic_filter/drop_{reason}"] = n
    if trainer_version is not None:
        metrics.update(staleness_metrics([s for s in samples if isinstance(s, Sample)], trainer_version))
    if getattr(args, "log_passrate", False):
        metrics.update(passrate_metrics(args, kept))
    if getattr(args, "log_reward_category", None):
        metrics.update(reward_category_metrics(samples, args.log_reward_category))
    if getattr(args, "log_multi_turn", False):
        metrics.update(multi_turn_metrics(samples, getattr(args, "rollout_max_response_len", None)))
    return metrics


def multi_turn_metrics(samples: list[Sample], max_response_len: int | None) -> dict[str, float]:
    """slime's --log-multi-turn: response lengths with and without the environment's tokens (loss mask 0)
    and the number of rounds (`metadata["round_number"]`, slime's key, else `metadata["turns"]`, this
    project's multi-turn example's), under `multi_turn/`."""
    if not samples:
        return {}
    raw = [s.response_length for s in samples]
    own = [sum(s.loss_mask) if s.loss_mask is not None else s.response_length for s in samples]
    out = {"multi_turn/raw_response_length/response_length_mean": statistics.fmean(raw),
           "multi_turn/raw_response_length/response_length_max": max(raw),
           "multi_turn/raw_response_length/response_length_min": min(raw),
           "multi_turn/wo_obs_response_length/response_length_mean": statistics.fmean(own),
           "multi_turn/wo_obs_response_length/response_length_max": max(own),
           "multi_turn/wo_obs_response_length/response_length_min": min(own)}
    if max_response_len:
        out["multi_turn/raw_response_length/response_length_clip_ratio"] = \
            sum(n >= max_response_len for n in raw) / len(raw)
    rounds = [r for s in samples if (r := s.metadata.get("round_number", s.metadata.get("turns"))) is not None]
    if rounds:
        out.update({"multi_turn/multi_turn_metric/round_number_mean": statistics.fmean(rounds),
                    "multi_turn/multi_turn_metric/round_number_max": max(rounds),
                    "multi_turn/multi_turn_metric/round_number_min": min(rounds)})
    return out


def passrate_metrics(args: Any, kept: list[list[Any]]) -> dict[str, float]:
    """slime's --log-passrate: `passrate/pass@k` for k = 1, 2, 4, ... up to the group size, a sample
    counting as correct when its reward is 1 (unbiased estimator, averaged over groups)."""
    per_group = [rewards for g in kept if (rewards := _reward_value(args, g))]
    size = min((len(r) for r in per_group), default=1)
    out: dict[str, float] = {}
    k = 1
    while k <= size and size > 1:
        out[f"passrate/pass@{k}"] = statistics.fmean(
            pass_at_k(len(r), sum(1 for v in r if v == 1), k) for r in per_group)
        k *= 2
    return out


def reward_category_metrics(samples: list[Sample], key: str) -> dict[str, float]:
    """slime's --log-reward-category: `error_cat/<category>`, the share of samples whose dict reward has
    that value under `key`."""
    categories = Counter(str(s.reward[key]) for s in samples if isinstance(s.reward, dict) and key in s.reward)
    return {f"error_cat/{category}": n / max(1, len(samples)) for category, n in categories.items()}


async def generate_rollout_async(args: Any, rollout_id: int, data_source: Any) -> RolloutFnTrainOutput:
    """One rollout step; see the module docstring. Aborted partial groups are put back into `data_source`.

    Runs on the caller's event loop and uses that loop's shared client (`slime.rollout.http`); call
    `close_engine_client()` when the loop is done with rollouts (`generate_rollout` does).
    """
    plugins = check_rollout_plugins(args)
    target = getattr(args, "rollout_batch_size", None)
    if not target:
        raise ConfigError("rollout needs rollout_batch_size (--rollout-batch-size)")
    over = getattr(args, "over_sampling_batch_size", None) or target
    check_not_written(args, "rollout", f"{rollout_id:06d}")
    client = engine_client(args)
    url = router_url(args)
    try:
        urls = await worker_urls(client, url)
    except EngineError as e:
        raise RolloutEngineError(f"cannot list the workers of router {url}: {e}") from e
    if not urls:
        raise RolloutEngineError(f"router {url} has no worker registered")
    state = GenerateState(args, plugins, len(urls), rollout_id=rollout_id)
    params = sampling_params_from_args(args)
    partial = bool(getattr(args, "partial_rollout", False))
    max_failed_in_a_row = max(target, over)
    max_filtered_in_a_row = FILTER_STARVATION_FACTOR * max(target, over)

    counts: Counter = Counter()
    reasons: Counter = Counter()
    kept: list[list[Any]] = []
    dropped: list[list[Any]] = []
    leftovers: list[list[Any]] = []
    all_groups: list[list[Any]] = []
    pending: set[asyncio.Task] = set()
    failed_in_a_row = filtered_in_a_row = 0
    first_error = ""
    started = time.perf_counter()
    try:
        while len(kept) < target:
            while len(kept) + len(pending) < target:
                groups = data_source.get_samples(over, rollout_id)
                counts["drawn"] += len(groups)
                pending |= {asyncio.create_task(state.generate_group(g, params)) for g in groups}
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for group in sorted((task.result() for task in done), key=_sort_key):
                kind = group_state(group)
                if kind == "failed":
                    all_groups.append(group)
                    counts["failed"] += 1
                    dropped.append(group)
                    failed_in_a_row += 1
                    first_error = first_error or first_error_of(group)
                    if failed_in_a_row >= max_failed_in_a_row:
                        raise RolloutEngineError(
                            f"{failed_in_a_row} groups in a row failed (kept {len(kept)}/{target}); first "
                            f"error: {first_error}")
                    continue
                if kind == "aborted" or len(kept) >= target:  # aborted by someone else, or surplus
                    leftovers.append(group)  # sorted out (and listed in all_groups) after the abort
                    continue
                all_groups.append(group)
                failed_in_a_row = 0
                rewards = _reward_value(args, group)
                if rewards is not None and len(rewards) > 1 and statistics.pstdev(rewards) <= 1e-6:
                    counts["zero_std"] += 1
                decision = call_dynamic_filter(plugins.dynamic_filter, args, group)
                if should_drop(decision, groups_live=len(kept) + len(pending) + 1, target=target):
                    counts["filtered"] += 1
                    reasons[decision.reason or "unspecified"] += 1
                    dropped.append(group)
                    filtered_in_a_row += 1
                    if filtered_in_a_row >= max_filtered_in_a_row:
                        raise FilterStarvedError(
                            f"dynamic filter {args.dynamic_sampling_filter_path!r} dropped {filtered_in_a_row} "
                            f"groups in a row (kept {len(kept)}/{target}; reasons {dict(reasons)}): it would "
                            "draw prompts forever. If every group gets the same reward (e.g. an untrained model "
                            "never answers correctly), use check_reward_nonzero_std_with_fallback or no filter")
                    continue
                filtered_in_a_row = 0
                if not kept:
                    sample = flatten(group)[0]
                    logger.info("rollout %s: first kept sample: %r -> %r (label %r, reward %r)", rollout_id,
                                str(sample.prompt)[:200], sample.response[:200], str(sample.label)[:100],
                                sample.reward)
                kept.append(group)
    except BaseException:
        if pending:
            await cancel(state, pending, urls)
        raise
    leftovers += await drain(state, pending, urls, refresh=lambda: worker_urls(client, url)) if pending else []
    elapsed = time.perf_counter() - started

    to_buffer = []
    for group in sorted(leftovers, key=_sort_key):
        all_groups.append(group)
        if group_state(group) == "failed":
            counts["failed"] += 1
            dropped.append(group)
        elif partial and all(isinstance(s, Sample) for s in group):
            for s in group:
                if s.response_length and "start_rollout_id" not in s.metadata:
                    s.metadata["start_rollout_id"] = rollout_id
            to_buffer.append(group)
        else:
            counts["aborted_dropped"] += 1
            dropped.append(group)
    if to_buffer:
        data_source.add_samples(to_buffer)
    counts["to_buffer"] = len(to_buffer)
    counts["kept"] = len(kept)
    for group in dropped:
        for s in flatten(group):
            counts["failed_samples"] += s.status is Status.FAILED
            counts["aborted_samples"] += s.status is Status.ABORTED
    accounted = sum(counts[k] for k in ("kept", "filtered", "failed", "aborted_dropped", "to_buffer"))
    if accounted != counts["drawn"]:
        raise RuntimeError(f"rollout {rollout_id}: {counts['drawn']} groups drawn but {accounted} accounted for "
                           f"({dict(counts)}); this is a bug")

    kept.sort(key=_sort_key)
    all_groups.sort(key=_sort_key)
    if plugins.sample_filter is not None:
        plugins.sample_filter(args, kept)
    if plugins.all_samples_process is not None:
        plugins.all_samples_process(args, all_groups, data_source)
    metrics = rollout_metrics(args, kept, counts, reasons, elapsed, state.new_tokens, trainer_version=rollout_id)
    uri = write_rollout(args, rollout_id, kept, dropped, metrics)
    if uri:
        metrics["rollout/uri"] = uri
    logger.info("rollout %s: kept %d groups (drawn %d, filtered %d, failed %d, aborted %d, to buffer %d) "
                "in %.2f s, %.0f tokens/s", rollout_id, counts["kept"], counts["drawn"], counts["filtered"],
                counts["failed"], counts["aborted_dropped"], counts["to_buffer"], elapsed,
                metrics["rollout/tokens_per_s"])
    return RolloutFnTrainOutput(samples=kept, metrics=metrics)


async def _run_and_close(coro: Any) -> Any:
    try:
        return await coro
    finally:
        await close_engine_client()


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout function: a train step's `RolloutFnTrainOutput`, or with `evaluation=True` the
    eval datasets' `RolloutFnEvalOutput` (`slime.rollout.eval`). Runs its own event loop; from async
    code await `generate_rollout_async` / `eval_rollout` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("generate_rollout runs its own event loop; in async code await "
                           "slime.rollout.generate_rollout_async(...) or slime.rollout.eval_rollout(...)")
    if evaluation:
        return asyncio.run(_run_and_close(eval_rollout(args, rollout_id)))
    return asyncio.run(_run_and_close(generate_rollout_async(args, rollout_id, data_source)))
