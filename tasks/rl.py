"""Task `rl`: the RL loop from a checkpoint into `{store}/{run_id}/rl/checkpoint`, one Prefect task per step.

The stage task is cached like every stage (config + input manifests + output + code). Its body builds
ONE `RLLoop` (Ray cluster, rollout manager, train group: long-lived actors) and drives it through small
per-step tasks - `rollout-0003`, `train-0003`, `save-0003`, `sync-0003`, `eval-0003` - that take the
loop object, are never cached or persisted (they return small dicts) and never create actors. A re-run
after a failure continues from the newest committed RL checkpoint of the same settings (`RLLoop.setup`).
The loop's progress and per-iteration metrics are published as Prefect artifacts while it runs.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
    TaskRunFilterTags,
)
from prefect.client.schemas.objects import StateType
from prefect.concurrency.sync import concurrency
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectNotFound
from prefect.states import State
from prefect.transactions import get_transaction

from slime.backends.megatron.checkpoint import latest_checkpoint
from slime.config import Config
from slime.errors import NotCommittedError
from slime.rl import RLLoop, read_metrics
from slime.stages.definitions import RL
from slime.stages.record import move_aside
from slime.storage import ArtifactStore, manifest_hash
from slime.storage.fs import open_fs
from slime.storage.staging import is_remote, newest_committed, staged
from tasks._cache import StageCachePolicy
from tasks._report import artifact_key
from tasks._stage import Phases, finish_stage, reused, stage_task, start_stage, with_fields
from tasks.evaluate import GPU_TAG

OUTPUT_NAME = "checkpoint"
# headline keys of a step record -> column of the metrics table
TABLE_COLUMNS = {"rl/reward_mean": "reward_mean", "rl/ppo_kl": "ppo_kl", "rl/ref_kl": "ref_kl",
                 "rl/grad_norm": "grad_norm", "rl/entropy": "entropy", "rl/rollout_s": "rollout_s",
                 "rl/train_s": "train_s", "rl/sync_s": "sync_s",
                 "rl/logprob_abs_diff": "logprob_abs_diff",
                 "async/groups/stale_dropped": "stale_dropped", "async/groups/stale_regenerated": "stale_regenerated",
                 "perf/trainer_idle_s": "trainer_idle_s", "perf/engine_idle_s": "engine_idle_s"}

# keyed on what defines the trained policy (slime/stages/definitions.py), as its record is
# the metrics table artifact, re-published every iteration, stays bounded however long the run: the last
# TABLE_WINDOW iterations row by row, earlier ones as one summary row per SUMMARY_BLOCK (every row of every
# iteration each time was n^2/2 rows sent to the Prefect API over a run); the complete log is metrics.jsonl
TABLE_WINDOW = 50
SUMMARY_BLOCK = 100
# and it is re-published every TABLE_EVERY iterations and after the last (each publication is a new version
# stored whole by the server: 3,000 per-iteration versions were 129 MB of its database; the progress artifact,
# updated in place, moves every iteration)
TABLE_EVERY = 10
CACHE = StageCachePolicy.of(RL, code_modules=("slime.rl.loop",))
# no tags on the step tasks: an RL iteration holds the GPU slot as a whole (gpu_slot)
STEP = {"cache_policy": NO_CACHE, "persist_result": False}
GPU_LIMIT = f"tag:{GPU_TAG}"  # the limit `prefect concurrency-limit create slime-gpu 1` makes (Prefect 3.8)
SLOT_LEASE_S = 600  # renewed in the background while an iteration runs
YIELD_TIMEOUT_S = 60.0  # the longest an iteration lets a waiting scheduled eval go first
YIELD_POLL_S = 0.5
WAITING_GPU_TASKS = TaskRunFilter(tags=TaskRunFilterTags(all_=[GPU_TAG]),
                                  state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.PENDING])))


def _timed(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The loop step's result plus `step_s`, its own time (the rest of a task call is Prefect's)."""
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return {**result, "step_s": time.perf_counter() - t0}


@task(name="rollout", task_run_name="rollout-{rollout_id:04d}", **STEP)
def rollout_step(loop: RLLoop, rollout_id: int) -> dict[str, Any]:
    """Generate rollout `rollout_id` into the store (its shard set URI and headline numbers)."""
    return _timed(loop.rollout, rollout_id)


@task(name="train", task_run_name="train-{rollout_id:04d}", **STEP)
def train_step(loop: RLLoop, rollout_id: int, uri: str) -> dict[str, Any]:
    return _timed(loop.train, rollout_id, uri)


@task(name="save", task_run_name="save-{rollout_id:04d}", **STEP)
def save_step(loop: RLLoop, rollout_id: int) -> dict[str, Any]:
    return _timed(loop.maybe_save, rollout_id)


@task(name="sync", task_run_name="sync-{rollout_id:04d}", **STEP)
def sync_step(loop: RLLoop, rollout_id: int) -> dict[str, Any]:
    return _timed(loop.sync, rollout_id)


@task(name="eval", task_run_name="eval-{rollout_id:04d}", **STEP)
def eval_step(loop: RLLoop, rollout_id: int, before_train: bool = False) -> dict[str, Any]:
    return _timed(loop.maybe_eval, rollout_id, before_train=before_train)


def table_row(record: dict[str, Any], prefect_s: float | None = None) -> dict[str, Any]:
    """One row of the per-iteration metrics table (rounded; missing values empty)."""
    row: dict[str, Any] = {"iteration": int(record["rollout_id"]), "weight_version": record.get("weight_version")}
    for key, column in TABLE_COLUMNS.items():
        value = record.get(key)
        row[column] = round(value, 6) if isinstance(value, float) else value
    lags = {int(k.rsplit("_", 1)[1]): v for k, v in record.items() if k.startswith("async/staleness/lag_")}
    row["staleness"] = " ".join(f"{lag}:{n}" for lag, n in sorted(lags.items())) or None  # versions behind: samples
    row.update(eval_columns(record))
    if prefect_s is not None:
        row["prefect_s"] = round(prefect_s, 3)
    return row


def eval_columns(record: dict[str, Any]) -> dict[str, Any]:
    """The eval part of a table row, keyed by the weight version and checkpoint evaluated (a background eval's
    line of the eval fleet, or a step record with an eval)."""
    evals = {k.split("/")[1]: v for k, v in record.items() if k.startswith("eval/") and k.endswith("/mean_reward")}
    return {"eval_mean_reward": ", ".join(f"{n} {v:.4f}" for n, v in sorted(evals.items())) or None,
            "eval_weight_version": record.get("eval/weight_version"), "eval_checkpoint": record.get("eval/checkpoint")}


def gpu_slot() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """How each RL iteration keeps a scheduled eval off the GPUs: one slot of the `slime-gpu` tag limit held
    for the whole iteration when that limit exists (the eval task carries the tag, so it runs between
    iterations or after the loop); nothing when it does not (`make run`'s ephemeral API, a server without it).

    Why not a tag on each step task, as before: Prefect asks the API for a slot lease and releases it for
    every task run with a tag, limit or not; with five tagged step tasks that was ten writes an iteration,
    and on SQLite one of them now and then found the database locked: 503, and Prefect's client retries 2 s
    later (bench/orchestration.py: 1.8-2.4 s stalls in 2% of iterations on CPU; 7 of 20 iterations of the
    GPU pipeline stalled ~2 s).
    """
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            return contextlib.nullcontext
    get_run_logger().info("each RL iteration holds a slot of %s (scheduled evals wait for it)", GPU_LIMIT)
    return functools.partial(_slot_after_waiting_evals, set())


@contextlib.contextmanager
def _slot_after_waiting_evals(stuck: set[Any]) -> Iterator[None]:
    """The iteration's slot, taken after a scheduled eval that waits for it (a task run tagged slime-gpu, Pending
    while its engine retries the slot) has taken it: the loop takes the slot again within milliseconds of letting
    it go, while a waiting task retries every few seconds (Prefect's Retry-After), so without this a scheduled eval
    of a run in progress waited for the run's end (a fully async run, whose generation never stops, is the case
    it was seen in: tests/flows/test_scheduled_eval_fully_async.py). One read of the API per iteration; a waiting
    run that has not started after YIELD_TIMEOUT_S is left behind (`stuck`) for the rest of the run."""
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + YIELD_TIMEOUT_S
        while waiting := [r.id for r in client.read_task_runs(task_run_filter=WAITING_GPU_TASKS, limit=5)
                          if r.id not in stuck]:
            if time.monotonic() > deadline:
                stuck.update(waiting)
                break
            time.sleep(YIELD_POLL_S)
    with concurrency([GPU_LIMIT], occupy=1, lease_duration=SLOT_LEASE_S):
        yield


def table_view(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows the metrics table artifact shows: one summary row (`iteration` "a-b", the mean of each
    numeric column) per full SUMMARY_BLOCK of iterations before the last TABLE_WINDOW, then those rows."""
    recent = rows[-TABLE_WINDOW:]
    older = rows[:len(rows) - len(recent)]
    view = []
    for start in range(0, len(older) - len(older) % SUMMARY_BLOCK, SUMMARY_BLOCK):
        block = older[start:start + SUMMARY_BLOCK]
        summary: dict[str, Any] = {"iteration": f"{block[0]['iteration']}-{block[-1]['iteration']}"}
        for column in block[-1]:
            values = [r[column] for r in block if isinstance(r.get(column), int | float) and not isinstance(
                r.get(column), bool)]
            if column != "iteration" and values:
                summary[column] = round(sum(values) / len(values), 6)
        view.append(summary)
    return view + older[len(older) - len(older) % SUMMARY_BLOCK:] + recent


@contextlib.contextmanager
def released_step_runs() -> Iterator[None]:
    """Let go of what Prefect keeps of an iteration's finished step task runs once the iteration is done, so the
    driver's memory stays flat over thousands of iterations (the 500-iteration soak: +80 KB per iteration).

    Inside the `rl` stage task, each step task's transaction becomes a child of the stage's, to be committed when
    the stage commits, and each step's result is entered in the flow run's `run_results` (for passing futures to
    later tasks). Both live until the stage ends: ~130 KB per iteration of five step tasks. The step tasks here
    cache nothing and persist nothing, so committing their transactions at the end of their iteration (on
    success only: a failed iteration is left to Prefect's rollback) changes nothing but when, and no later task
    receives an earlier iteration's result object."""
    flow_run = FlowRunContext.get()
    stage = get_transaction()
    known = set(flow_run.run_results) if flow_run is not None else set()
    first_child = len(stage.children) if stage is not None else 0
    yield
    if stage is not None:
        for child in stage.children[first_child:]:
            child.commit()
        del stage.children[first_child:]
    if flow_run is not None:
        for key in set(flow_run.run_results) - known:
            del flow_run.run_results[key]


def drive(loop: RLLoop, run_id: str, phases: Phases, after_save: Callable[[], Any] | None = None
          ) -> list[dict[str, Any]]:
    """Every remaining iteration as step tasks, with a progress artifact and the metrics table updated
    after each; the rows. `prefect_s` of a row: the iteration's wall time minus the loop's own steps.
    `after_save` runs after each checkpoint (uploads it when the store is remote)."""
    progress = create_progress_artifact(0.0, key=artifact_key(run_id, "rl", "progress"),
                                        description=f"RL iterations of run {run_id}")
    rows = [table_row(r) for i, r in sorted(read_metrics(loop.metrics_uri, loop.store.storage_options).items())
            if i < loop.start_rollout_id]  # iterations of an earlier attempt, kept by the resume
    table_s = 0.0  # the previous iteration's table artifact, counted in this iteration's prefect_s
    slot = gpu_slot()
    for rollout_id in range(loop.start_rollout_id, loop.num_rollout):
        started, inside, tasks_s = time.perf_counter(), 0.0, 0.0

        def step(name: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            nonlocal inside, tasks_s
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            spent = time.perf_counter() - t0
            phases.seconds[name] = round(phases.seconds.get(name, 0.0) + spent, 3)
            inside += result["step_s"]
            tasks_s += spent - result["step_s"]
            return result

        with released_step_runs(), slot():  # the GPUs for this iteration (scheduled evals wait)
            if loop.eval_due(rollout_id, before_train=True):
                step("eval", eval_step, loop, rollout_id, before_train=True)
            rollout = step("rollout", rollout_step, loop, rollout_id)
            step("train", train_step, loop, rollout_id, rollout["uri"])
            if loop.save_due(rollout_id):
                step("save", save_step, loop, rollout_id)
                if after_save is not None:
                    after_save()
            step("sync", sync_step, loop, rollout_id)
            if loop.eval_due(rollout_id):
                step("eval", eval_step, loop, rollout_id)
            t0 = time.perf_counter()
            record = loop.log_step(rollout_id)
            inside += time.perf_counter() - t0  # the loop's own bookkeeping, not Prefect's
        t0 = time.perf_counter()
        done = (rollout_id + 1) / loop.num_rollout
        update_progress_artifact(progress, 100.0 * done,
                                 description=f"run {run_id}: iteration {rollout_id + 1} of {loop.num_rollout}")
        artifacts_s = time.perf_counter() - t0 + table_s
        prefect_s = time.perf_counter() - started - inside + table_s
        get_run_logger().info("iteration %d: Prefect %.3f s (task calls beyond their steps %.3f s, artifacts %.3f s, "
                    "other %.3f s)", rollout_id, prefect_s, tasks_s, artifacts_s, prefect_s - tasks_s - artifacts_s)
        rows.append(table_row(record, prefect_s))
        for line in record.get("evals", []):  # eval-fleet results that ended now: into their own iteration's row
            for row in rows:
                if row["iteration"] == line["rollout_id"]:
                    row.update(eval_columns(line))
        table_s = 0.0
        if (rollout_id + 1) % TABLE_EVERY and rollout_id + 1 < loop.num_rollout:
            continue
        t0 = time.perf_counter()
        create_table_artifact(table_view(rows), key=artifact_key(run_id, "rl", "metrics"),
                              description=f"RL metrics per iteration, run {run_id} (prefect_s: orchestration; the last "
                                          f"{TABLE_WINDOW} iterations, earlier ones averaged per {SUMMARY_BLOCK}; "
                                          f"every iteration: {loop.metrics_uri})")
        table_s = time.perf_counter() - t0
    return rows


@stage_task("rl", CACHE)
def rl(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any] | State:
    """RL from `inputs["load"]` on `inputs["prompt_data"]` (tokenizer/engines: `inputs["hf_checkpoint"]`).

    `output` is the checkpoint save root; resumes from its newest committed checkpoint of the same settings.
    """
    run_config = with_fields(config, checkpoint__load=inputs["load"], checkpoint__save=output,
                             checkpoint__hf_checkpoint=inputs["hf_checkpoint"], data__prompt_data=inputs["prompt_data"])
    phases, start = start_stage(RL, run_config)
    if start.reused is not None:
        return reused(start)
    with staged(run_config) as (local, staging):  # checkpoints in a remote store: local copies, uploaded after
        with phases.time("prepare output"):
            if latest_checkpoint(local.checkpoint.save) is None:
                set_aside_step_outputs(config, run_id)
        loop = RLLoop(local, staging=staging)
        try:
            with phases.time("setup"):
                setup = loop.setup()
            rows = drive(loop, run_id, phases, after_save=staging.publish)
        finally:
            with phases.time("close"):
                loop.close()
        checkpoint = latest_checkpoint(local.checkpoint.save)
    checkpoint = checkpoint and staging.to_remote(checkpoint)
    if is_remote(output):  # train ranks on other nodes commit their saves in the store, not in the driver's copy
        checkpoint = newest_committed(output, config.run.storage_options) or checkpoint
    if checkpoint is None:
        raise NotCommittedError(f"rl finished without a committed checkpoint under {output}: set checkpoint.save_interval")
    records = read_metrics(loop.metrics_uri, loop.store.storage_options)
    last = records[max(records)] if records else {}
    metrics = {"start_rollout_id": setup["start_rollout_id"], "num_rollout": loop.num_rollout,
               "resumed": setup["resumed"], "iterations_run": loop.num_rollout - setup["start_rollout_id"],
               "reward_mean_last": last.get("rl/reward_mean"), "metrics_uri": loop.metrics_uri,
               "prefect_s_per_iteration": _mean([r["prefect_s"] for r in rows if "prefect_s" in r])}
    # LoRA: rank, trainable / total parameters and peak memory of the train rank (docs/lora.md)
    metrics.update({key.replace("/", "_"): value for key, value in last.items() if key.startswith("lora/")})
    artifacts = {"checkpoint": {"uri": checkpoint, "manifest_hash": manifest_hash(checkpoint, config.run.storage_options)}}
    return finish_stage(start, {"stage": "rl", "artifacts": artifacts, "metrics": metrics}, phases, rows=rows)


def set_aside_step_outputs(config: Config, run_id: str) -> list[str]:
    """Before a start from iteration 0: move the run's rollout/eval step outputs and metrics log of an
    earlier attempt aside (committed step outputs are never overwritten, and a fresh loop rewrites them)."""
    store = ArtifactStore.from_config(config)
    moved = []
    for uri in (store.uri(run_id, "rollout"), store.uri(run_id, "rollout_dropped"), store.uri(run_id, "eval"),
                store.uri(run_id, "rl", "metrics.jsonl")):
        fs, path = open_fs(uri, store.storage_options)
        if fs.exists(path):
            moved.append(move_aside(fs, path))
    return moved


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None
