"""What every stage task does around its one slime call: the task decorator, point the config at the
run's locations, ask the stage's record what to do (reuse, resume, start, refuse), time the phases and
describe the result as JSON."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prefect import task
from prefect.states import Completed, State

from slime.config import Config
from slime.stages.record import StageDefinition, StageStart, begin_stage
from tasks._cache import StageCachePolicy

logger = logging.getLogger(__name__)


def stage_task(name: str, cache: StageCachePolicy, **options: Any) -> Callable[[Callable], Any]:
    """`@task` of a stage `fn(config, run_id, inputs, output)`: run name `<name>-<run_id>` (unless
    `task_run_name` is given), `cache` as its cache policy, its JSON result persisted so that a re-run
    of the pipeline finds it; `options` are further `@task` arguments (tags, ...)."""
    options.setdefault("task_run_name", f"{name}-{{run_id}}")
    return task(name=name, cache_policy=cache, persist_result=True, result_serializer="json", **options)


def with_fields(config: Config, **dotted: Any) -> Config:
    """A validated copy of `config` with `section__field=value` fields replaced (the original is untouched)."""
    data = config.model_dump(mode="json")
    for key, value in dotted.items():
        section, field = key.split("__")
        data[section][field] = value
    return Config.model_validate(data)


def start_stage(definition: StageDefinition, config: Config) -> tuple[Phases, StageStart]:
    """The phase timer of a stage run and what the stage's record decided (slime/stages/record.py): reuse a
    finished output with these settings, resume or start, or refuse other settings without --overwrite."""
    phases = Phases()
    with phases.time("prepare output"):
        start = begin_stage(definition, config)
    return phases, start


def reused(start: StageStart) -> State:
    """The state of a task whose stage was done already with these settings (committed by any entry point,
    `slime <stage>` included): Completed, named Cached as a Prefect cache hit is, with the recorded result."""
    return Completed(name="Cached", data={**start.reused, "record": start.record_uri},
                     message=f"{start.output} is done with these settings ({start.record_uri}): reused")


class Phases:
    """Wall time per named phase, for the stage report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - start, 3)


def stage_result(stage: str, artifacts: dict[str, tuple[str, str]], metrics: dict[str, Any],
                 phases: Phases, **extra: Any) -> dict[str, Any]:
    """The JSON result a stage task returns and Prefect persists: artifact URIs with manifest hashes,
    small metrics and phase times. `artifacts` maps a name to (uri, manifest hash)."""
    return {"stage": stage,
            "artifacts": {name: {"uri": uri, "manifest_hash": digest} for name, (uri, digest) in artifacts.items()},
            "metrics": metrics, "seconds": phases.seconds, **extra}


def finish_stage(start: StageStart, summary: dict[str, Any], phases: Phases, **extra: Any) -> dict[str, Any]:
    """The task's result (`summary` from slime.stages.definitions.summarize, with phase times and `extra`),
    recorded beside the output as done, so that `slime <stage>` and later runs reuse it."""
    result = {**summary, "seconds": phases.seconds, **extra}
    start.finish(result)
    return result
