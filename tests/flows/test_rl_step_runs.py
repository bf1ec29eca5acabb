"""What Prefect keeps of the RL stage's step task runs: bounded per iteration (tasks/rl.py `released_step_runs`),
where it otherwise grows with every iteration until the stage ends (the soak's driver: +80 KB per iteration)."""

import contextlib

import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.transactions import get_transaction

from tasks.rl import STEP, released_step_runs

committed: list[int] = []


@task(**STEP)
def step(i: int) -> dict:
    return {"i": i, "payload": "x" * 100}


@step.on_commit
def _record_commit(txn) -> None:
    committed.append(1)


@task(cache_policy=NO_CACHE, persist_result=False)
def stage(iterations: int, release: bool) -> list[tuple[int, int]]:
    """Like the `rl` stage task: step tasks called inside a task; (transaction children, run results) after each."""
    sizes = []
    for i in range(iterations):
        with released_step_runs() if release else contextlib.nullcontext():
            for _ in range(3):
                assert step(i)["i"] == i
        sizes.append((len(get_transaction().children), len(FlowRunContext.get().run_results)))
    return sizes


@flow
def run(iterations: int, release: bool) -> list[tuple[int, int]]:
    return stage(iterations, release)


@pytest.mark.parametrize("release", [True, False])
def test_step_runs_are_let_go_after_each_iteration(prefect_api, release):
    committed.clear()
    sizes = run(12, release)
    if release:
        assert sizes[-1] == sizes[0] == (0, 0), sizes  # nothing left behind by any iteration
        assert len(committed) == 36  # every step's transaction committed, at the end of its iteration
    else:  # without it Prefect keeps each iteration's three runs: what the driver's memory grew by
        assert [s[0] for s in sizes] == [3 * (i + 1) for i in range(12)], sizes
        assert sizes[-1][1] >= 36
