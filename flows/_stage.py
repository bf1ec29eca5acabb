"""What every stage flow shares: resolve the run (config, store, run id), run the stage task against
the store's result storage, and say whether it ran or was reused."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from prefect import Task
from prefect.runtime import flow_run

from slime.config import Config, load_config
from slime.errors import NotCommittedError
from slime.preflight import prepare_run
from slime.storage import ArtifactStore
from slime.storage.lease import hold_stage
from slime.storage.staging import newest_committed
from tasks._cache import result_storage
from tasks._report import publish_stage_report


def resolve_run(config: str, overrides: list[str] | None, store: str | None, run_id: str | None, *,
                prepare: bool = True, needs_device: bool = True) -> tuple[Config, str]:
    """The validated config (file, then overrides, then `store`/`run_id`) and the run id to use.

    Without a run id anywhere, the run is named after the flow run's scheduled start time
    (`run-YYYYmmdd-HHMMSS`), the same value the flow run name shows. `prepare`: the kit is built when
    missing and every input path checked (slime.preflight), before any task starts; `needs_device` False for
    the stages that run without a GPU (convert, export), so a GPU configuration is not refused on a CPU machine.
    """
    tokens = list(overrides or [])
    if store:
        tokens += ["--store", store]
    if run_id:
        tokens += ["--run-id", run_id]
    resolved = load_config(config, tokens)
    if resolved.run.run_id is None:
        started = flow_run.scheduled_start_time or dt.datetime.now(dt.UTC)
        resolved = resolved.model_copy(update={"run": resolved.run.model_copy(
            update={"run_id": f"run-{started.strftime('%Y%m%d-%H%M%S')}"})})
    if prepare:
        resolved = prepare_run(resolved, needs_device=needs_device)
    return resolved, resolved.run.run_id


def run_name(stage: str) -> Any:
    """A flow_run_name callable: `<stage>-<run id>`, from the flow run's own parameters."""

    def name() -> str:
        params = flow_run.parameters
        try:
            _, run_id = resolve_run(params["config"], params.get("overrides"), params.get("store"),
                                    params.get("run_id"), prepare=False)
        except Exception:  # a bad config fails in the flow body, with its real message
            run_id = params.get("run_id") or "unresolved"
        return f"{stage}-{run_id}"

    return name


def output_uri(config: Config, run_id: str, stage: str, name: str) -> str:
    """`{store}/{run_id}/{stage}/{name}`: where a stage writes."""
    return ArtifactStore.from_config(config).uri(run_id, stage, name)


def newest_model(config: Config, run_id: str, stages: tuple[str, ...]) -> str:
    """The newest committed checkpoint of the first of `stages` that has one, for a stage run alone."""
    for stage in stages:
        found = newest_committed(output_uri(config, run_id, stage, "checkpoint"), config.run.storage_options)
        if found is not None:
            return found
    raise NotCommittedError(f"run {run_id!r} in {config.run.store} has no committed checkpoint from "
                            f"{' or '.join(stages)}; run that stage first or pass --model CHECKPOINT")


def run_stage(stage_task: Task, config: Config, run_id: str, inputs: dict[str, str], output: str,
              decorate: Callable[[dict[str, Any], Config], None] | None = None, *, watch: bool = False
              ) -> dict[str, Any]:
    """Run (or reuse) one stage task; returns its result plus `status` ("ran" or "cached") and `run_id`.

    Failures propagate (the flow fails, and a re-run resumes here). The stage report is published
    for reused results too, since Prefect does not re-create artifacts of cached task runs;
    `decorate(summary, config)` may add `figures` to it first (drawn from the stored artifacts). The
    stage holds the run's lease (slime.storage.lease; `watch`: a scheduled eval, only the evaluate lease).
    """
    # the results of a run's stages live in the run's directory, like everything else it writes
    storage = result_storage(ArtifactStore.from_config(config).uri(run_id), config.run.storage_options)
    with hold_stage(config, stage_task.name, watch=watch):  # one writer per run (the pipeline holds it already)
        state = stage_task.with_options(result_storage=storage)(config, run_id, inputs, output, return_state=True)
    result = state.result()
    summary = {**result, "status": "cached" if state.name == "Cached" else "ran", "run_id": run_id,
               "inputs": inputs}
    if decorate is not None:
        decorate(summary, config)
    publish_stage_report(summary, config, stage_task.cache_policy.config_fields)
    for figure in summary.get("figures", []):
        figure.pop("embed", None)  # the image is in the report and the store; the result stays small
    return summary
