"""The scheduled eval (`evaluate/evaluate-newest`: flows.evaluate with `eval_watch_run`) pointed at a fully async
RL run while it trains: the RL flow runs as its own process (as a deployment's worker runs it) against the
same Prefect API, with the `slime-gpu` tag limit at 1 (what `make serve` creates); once the run has committed
a checkpoint, the watch flow evaluates its newest one while the run goes on. Checked: the run was still
training when the eval began and went on after it, the eval's task never held the GPUs while an RL
iteration did (the limit respected: it ran between two iterations), and the result is keyed by the
checkpoint's rollout id and weight version, in the flow's result and the eval table artifact."""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterName,
    TaskRunFilter,
    TaskRunFilterName,
)
from prefect.settings import PREFECT_API_URL

from flows.evaluate import evaluate_flow
from slime.backends.megatron.checkpoint import latest_checkpoint
from tasks._report import artifact_key
from tasks.convert import convert
from tasks.evaluate import GPU_TAG

ROOT = Path(__file__).resolve().parents[2]
TINY_CPU = ROOT / "deployments" / "tiny-cpu.yaml"
NUM_ROLLOUT = 6
RUN_TIMEOUT_S = 600


@pytest.mark.slow  # about 3 minutes on the shared 2-core machine: an RL run and an eval (export, engine) at once
def test_the_scheduled_eval_evaluates_a_running_fully_async_run_between_its_iterations(prefect_api, tiny_kit,
                                                                                      tmp_path):
    store = tmp_path / "store"
    overrides = ["--hf-checkpoint", str(tiny_kit.model_dir), "--prompt-data", str(tiny_kit.train),
                 "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "2", "--global-batch-size", "8",
                 "--micro-batch-size", "4", "--save-interval", "1", "--async-mode", "fully",
                 "--max-policy-version-lag", "1", "--partial-rollout",
                 "--eval-prompt-data", "arithmetic", f"{tiny_kit.eval}@[0:4]"]
    from slime.config import load_config

    config = load_config(str(TINY_CPU), overrides)
    start = convert.fn(config, "t", {"hf_checkpoint": str(tiny_kit.model_dir)},
                       str(store / "t" / "convert" / "checkpoint"))["artifacts"]["checkpoint"]["uri"]
    save = store / "t" / "rl" / "checkpoint"
    with get_client(sync_client=True) as client:
        with contextlib.suppress(Exception):
            client.delete_concurrency_limit_by_tag(GPU_TAG)
        client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=1)
    log = tmp_path / "rl.log"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        rl = subprocess.Popen([sys.executable, "-m", "flows.rl", "--config", str(TINY_CPU), "--store", str(store),
                               "--run-id", "t", "--model", start, *overrides], cwd=ROOT, env=env, stdout=out,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while latest_checkpoint(str(save)) is None:
            assert rl.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no RL checkpoint in time"
            time.sleep(0.5)
        watch = {"config": str(TINY_CPU), "overrides": overrides, "store": str(store)}
        evaluated = evaluate_flow(**watch, eval_watch_run="t")
        running_after = rl.poll() is None
        assert rl.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-3000:]
    finally:
        if rl.poll() is None:
            rl.kill()
            rl.wait()
    assert evaluated["status"] == "ran", evaluated
    checkpoint = evaluated["metrics"]["checkpoint"]
    iteration = int(checkpoint.rsplit("iter_", 1)[1])
    assert iteration < NUM_ROLLOUT - 1 and running_after  # a checkpoint of the run while it trained
    assert evaluated["metrics"]["rollout_id"] == iteration and evaluated["metrics"]["weight_version"] == iteration + 1
    table = Artifact.get(artifact_key("t", "evaluate", "results")).data
    assert f'"rollout_id": {iteration}' in table and f'"weight_version": {iteration + 1}' in table

    with get_client(sync_client=True) as client:
        rl_run = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["rl-t"])))[0]
        steps = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[rl_run.id])))
        [eval_task] = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(
            like_="evaluate-t-")))
        client.delete_concurrency_limit_by_tag(GPU_TAG)
    # an iteration holds the slot from its first step task to its last: the eval ran in no iteration's span
    spans = {}
    for task in steps:
        if task.name[-4:].isdigit() and task.start_time is not None:
            first, last = spans.get(int(task.name[-4:]), (task.start_time, task.end_time))
            spans[int(task.name[-4:])] = (min(first, task.start_time), max(last, task.end_time))
    assert sorted(spans) == list(range(NUM_ROLLOUT))
    began, ended = eval_task.start_time, eval_task.end_time
    assert all(ended <= first or began >= last for first, last in spans.values()), (began, ended, spans)
    assert any(first >= ended for first, _ in spans.values())  # iterations ran after it: the run went on
