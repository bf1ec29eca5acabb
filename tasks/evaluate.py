"""Task `evaluate`: one checkpoint on every eval dataset; result committed under
`{store}/{run_id}/evaluate/{label}-{key10}` (slime.stages.evaluate names it, see `plan_evaluate`)."""

from __future__ import annotations

from typing import Any

from prefect.runtime import task_run
from prefect.states import Completed, State

from slime.config import Config
from slime.stages.evaluate import run_evaluate
from slime.stages.record import move_aside
from slime.storage import is_committed
from slime.storage.fs import open_fs
from tasks._cache import StageCachePolicy
from tasks._stage import Phases, stage_result, stage_task, with_fields

# what an eval result depends on besides the checkpoint and the eval datasets (inputs); the same
# sections as slime.stages.evaluate.eval_settings, whose key also names the output directory
CONFIG_FIELDS = ("eval", "rollout", "reward", "data", "engine", "sglang", "run.seed")
# task tag: `prefect concurrency-limit create slime-gpu 1` keeps evals and RL iterations off the GPUs at once
GPU_TAG = "slime-gpu"

CACHE = StageCachePolicy(config_fields=CONFIG_FIELDS, code_modules=("slime.stages.evaluate",))


def eval_run_name() -> str:
    """`evaluate-<run id>-<result directory>` (the directory names the checkpoint, e.g. rl-iter_0000003-...)."""
    params = task_run.parameters
    return f"evaluate-{params['run_id']}-{params['output'].rstrip('/').rsplit('/', 1)[-1]}"


@stage_task("evaluate", CACHE, task_run_name=eval_run_name, tags=[GPU_TAG])
def evaluate(config: Config, run_id: str, inputs: dict[str, str], output: str) -> dict[str, Any] | State:
    """Evaluate `inputs["load"]` (eval datasets: the other inputs); `output` is where plan_evaluate puts it."""
    phases = Phases()
    with phases.time("prepare output"):
        set_aside_unfinished(output, config.run.storage_options)
    with phases.time("evaluate"):
        result = run_evaluate(with_fields(config, checkpoint__load=inputs["load"], eval__eval_watch_run=None))
    if result["result"] != output:
        raise RuntimeError(f"evaluate wrote {result['result']}, planned {output}: the plan and the run disagree")
    metrics = {"checkpoint": result["checkpoint"], "rollout_id": result.get("checkpoint_rollout_id"),
               "weight_version": result.get("checkpoint_weight_version"), "reused": result["reused"],
               "datasets": result["metrics"],
               "evaluate_phases_s": {k: round(v, 3) for k, v in result.get("phases", {}).items()}}
    summary = stage_result("evaluate", {"eval_result": (result["result"], result["manifest_hash"])}, metrics, phases)
    if result["reused"]:  # committed already with these settings, by this flow or `slime evaluate`
        return Completed(name="Cached", data=summary, message=f"{output} is committed with these settings: reused")
    return summary


def set_aside_unfinished(output: str, storage_options: dict[str, Any] | None) -> None:
    """An uncommitted result directory is a failed attempt: moved aside. A committed one is named by the hash
    of its settings (plan_evaluate), so run_evaluate reuses it (or refuses a key that differs)."""
    fs, path = open_fs(output, storage_options)
    if fs.exists(path) and not is_committed(output, storage_options):
        move_aside(fs, path)
