"""Flow `evaluate`: evaluate checkpoints of a run on every eval dataset; also the scheduled "watch" eval.

    python -m flows.evaluate --config deployments/tiny-cpu.yaml [--run-id ID] [--model CKPT]
    python -m flows.evaluate --config deployments/tiny-cpu.yaml --eval-watch-run tiny-cpu    # what the schedule runs

Without `--model` it evaluates the run's newest committed checkpoint of `rl`, else `sft`, else `convert`;
`compare` (a flow parameter) adds more checkpoints, e.g. the pipeline's SFT one for the accuracy-per-stage
table. With `eval_watch_run` it evaluates the newest committed checkpoint of that run (results under that
run unless `run_id` says otherwise) and skips, without starting engines, when there is none yet or it was
evaluated with this config already. The task carries the tag `slime-gpu`: with
`prefect concurrency-limit create slime-gpu 1` a scheduled eval waits while an RL iteration holds the GPUs.
Artifacts: `<run>-evaluate-report` (markdown per evaluated checkpoint, the last one wins the key) and
`<run>-evaluate-results` (table: checkpoint, dataset, mean reward, pass@k, ...).
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows._cli import DEFAULT_CONFIG, main
from flows._stage import newest_model, resolve_run, run_name, run_stage
from slime.config import Config
from slime.stages.evaluate import plan_evaluate
from slime.storage import is_committed
from tasks._report import publish_eval_table
from tasks._stage import with_fields
from tasks.evaluate import evaluate

MODEL_STAGES = ("rl", "sft", "convert")


def eval_inputs(config: Config, model: str) -> dict[str, str]:
    """The checkpoint and every eval dataset file (their content is part of the cache key)."""
    inputs = {"load": model}
    for name, path in sorted((config.eval.eval_prompt_data or {}).items()):
        inputs[f"eval_data_{name}"] = path
    if config.eval.eval_config:
        inputs["eval_config"] = config.eval.eval_config
    return inputs


def evaluate_one(config: Config, run_id: str, model: str, watch: bool = False) -> dict[str, Any]:
    """Evaluate (or reuse the evaluation of) one checkpoint; the output directory is slime.stages.evaluate's plan.
    `watch`: a scheduled eval beside the run's own writer (it takes only the evaluate lease)."""
    plan = plan_evaluate(with_fields(config, checkpoint__load=model, eval__eval_watch_run=None))
    return run_stage(evaluate, config, run_id, eval_inputs(config, model), plan.uri, watch=watch)


def evaluate_run_name() -> str:
    """`evaluate-<run id>`; a watch run without `run_id` is named after the watched run, where its results go."""
    params = flow_run.parameters
    if params.get("eval_watch_run") and not params.get("run_id"):
        return f"evaluate-{params['eval_watch_run']}"
    return run_name("evaluate")()


@flow(name="evaluate", flow_run_name=evaluate_run_name)
def evaluate_flow(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, store: str | None = None,
                  run_id: str | None = None, model: str | None = None, compare: list[str] | None = None,
                  eval_watch_run: str | None = None) -> dict[str, Any]:
    """Evaluate `model` (default: the run's newest checkpoint) and every checkpoint in `compare`; with
    `eval_watch_run`, the newest checkpoint of that run unless it was evaluated already."""
    tokens = list(overrides or []) + (["--eval-watch-run", eval_watch_run] if eval_watch_run else [])
    cfg, run_id = resolve_run(config, tokens, store, run_id or eval_watch_run)
    if cfg.eval.eval_watch_run:
        plan = plan_evaluate(cfg)
        reason = plan.reason if plan.uri is None else (
            f"{plan.source} was evaluated with this config already: {plan.uri}"
            if is_committed(plan.uri, cfg.run.storage_options) else None)
        if reason is not None:
            get_run_logger().info("evaluate: skipped: %s", reason)
            return {"stage": "evaluate", "status": "skipped", "reason": reason, "run_id": run_id, "artifacts": {}}
        model = plan.source
        cfg = with_fields(cfg, eval__eval_watch_run=None)  # the same cache key as an eval of that checkpoint
    model = model or newest_model(cfg, run_id, MODEL_STAGES)
    watch = bool(eval_watch_run)  # beside the run's writer: only the evaluate lease
    compared = [evaluate_one(cfg, run_id, other, watch) for other in compare or []]
    result = evaluate_one(cfg, run_id, model, watch)  # last: its report is the one under <run>-evaluate-report
    publish_eval_table(run_id, [*compared, result])
    return {**result, "compared": compared}


if __name__ == "__main__":
    sys.exit(main(evaluate_flow, takes_model=True))
