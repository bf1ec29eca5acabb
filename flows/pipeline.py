"""Flow `post-training`: the whole pipeline, one stage flow per line, over one run of the store.

    python -m flows.pipeline --config deployments/tiny-cpu.yaml [--store URL] [--run-id ID] [--flag value ...]

Each stage reads its input from the previous stage's committed artifact and writes to
`{store}/{run_id}/{stage}/`. A stage whose inputs and config are unchanged is reused (Prefect state
Cached, nothing recomputed); a re-run of a failed pipeline (same parameters, or `prefect flow-run
retry`) therefore continues at the failed stage. What each stage consumes: rejection_sampling samples the SFT checkpoint (its accepted set is reported,
not trained on), rl starts from the SFT checkpoint, evaluate evaluates the RL checkpoint and the SFT one
(accuracy per stage), export exports the RL checkpoint. `skip` leaves optional stages out (listed as
"skipped"; rl skipped: evaluate and export take the SFT checkpoint).
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger

from flows._cli import DEFAULT_CONFIG, main
from flows._stage import resolve_run, run_name
from flows.convert import convert_flow
from flows.evaluate import evaluate_flow
from flows.export import export_flow
from flows.rejection_sampling import rejection_sampling_flow
from flows.rl import rl_flow
from flows.sft import sft_flow
from slime.config import Config
from slime.errors import ConfigError
from slime.storage.lease import hold_run
from tasks._report import publish_pipeline_table
from tasks.export_check import check_export

# DESIGN.md's stage order; OPTIONAL ones can be left out with `skip`
STAGE_ORDER = ("convert", "sft", "rejection_sampling", "rl", "evaluate", "export")
OPTIONAL = ("rejection_sampling", "rl", "evaluate")


def checkpoint_of(result: dict[str, Any]) -> str:
    return result["artifacts"]["checkpoint"]["uri"]


@flow(name="post-training", flow_run_name=run_name("post-training"))
def pipeline(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, store: str | None = None,
             run_id: str | None = None, skip: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """convert -> sft -> rejection_sampling -> rl -> evaluate -> export (`skip`: optional stages left out)."""
    resolved, run_id = resolve_run(config, overrides, store, run_id)
    skip = list(skip or [])
    if unknown := set(skip) - set(OPTIONAL):
        raise ConfigError(f"pipeline skip={sorted(unknown)}: only {', '.join(OPTIONAL)} can be skipped")
    common = {"config": config, "overrides": overrides, "store": store, "run_id": run_id}
    results: dict[str, dict[str, Any]] = {}
    with hold_run(resolved):  # one writer per run, for the whole pipeline (each stage flow re-enters it)
        try:
            results["convert"] = convert_flow(**common)
            results["sft"] = sft_flow(**common, model=checkpoint_of(results["convert"]))
            sft_checkpoint = final = checkpoint_of(results["sft"])
            if "rejection_sampling" not in skip:
                results["rejection_sampling"] = rejection_sampling_flow(**common, model=sft_checkpoint)
            if "rl" not in skip:
                results["rl"] = rl_flow(**common, model=sft_checkpoint)
                final = checkpoint_of(results["rl"])
            if "evaluate" not in skip:
                # the untrained (converted) model and SFT as well, for accuracy stage over stage
                earlier = [checkpoint_of(results["convert"]), *([sft_checkpoint] if final != sft_checkpoint else [])]
                results["evaluate"] = evaluate_flow(**common, model=final, compare=earlier)
            results["export"] = export_flow(**common, model=final)
            if "evaluate" in results:
                results["export"]["answers_check"] = check_exported_model(results, config, overrides, store, run_id)
        finally:
            publish_pipeline_table(run_id, stage_rows(results, skip))
            logger = get_run_logger()
            for row in stage_rows(results, skip):
                logger.info("%-18s %s %s", row["stage"], row["status"], row["artifact"])
    return results


def check_exported_model(results: dict[str, dict[str, Any]], config: str, overrides: list[str] | None,
                         store: str | None, run_id: str) -> dict[str, Any]:
    """The exported HF model answers the greedy eval datasets as the evaluate stage scored the same checkpoint."""
    cfg, _ = resolve_run(config, overrides, store, run_id)
    evaluated = results["evaluate"]
    greedy = [name for name in evaluated["metrics"]["datasets"] if greedy_eval(cfg, name)]
    if not greedy:
        get_run_logger().info("no greedy eval dataset: the exported model's answers are not compared")
        return {}
    return check_export(cfg, run_id, results["export"]["artifacts"]["hf_model"]["uri"],
                        evaluated["artifacts"]["eval_result"]["uri"], greedy)


def greedy_eval(config: Config, dataset: str) -> bool:
    from slime.rollout.eval import dataset_sampling_params, eval_datasets

    args = config.as_namespace()
    return any(ds.name == dataset and dataset_sampling_params(args, ds).get("temperature") == 0
               for ds in eval_datasets(args))


def stage_rows(results: dict[str, dict[str, Any]], skip: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per stage of DESIGN.md's pipeline: ran, cached, skipped, or not completed."""
    rows = []
    for stage in STAGE_ORDER:
        result = results.get(stage)
        if result is not None:
            status = result["status"]
            artifact = ", ".join(a["uri"] for a in result["artifacts"].values())
            seconds = round(sum(result.get("seconds", {}).values()), 2)
        else:
            status = "skipped" if stage in (skip or ()) else "not completed"
            artifact, seconds = "", None
        rows.append({"stage": stage, "status": status, "artifact": artifact, "seconds": seconds})
    return rows


def describe(results: dict[str, dict[str, Any]]) -> str:
    """The end-of-run summary: per stage status, time and artifacts; held-out accuracy of the checkpoint each
    stage produced (untrained, SFT, RL); the RL loop; the exported HF directory."""
    rows = stage_rows(results)
    total = sum(r["seconds"] or 0.0 for r in rows)
    lines = [f"{'stage':<19}{'status':<15}{'seconds':>8}  artifact"]
    for r in rows:
        seconds = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
        lines.append(f"{r['stage']:<19}{r['status']:<15}{seconds:>8}  {r['artifact']}")
    lines.append(f"{'total':<34}{total:>8.1f}")
    if "evaluate" in results:
        produced_by = {results[s]["artifacts"].get("checkpoint", {}).get("uri"): s
                       for s in ("convert", "sft", "rl") if s in results}
        label = {"convert": "untrained (convert)", "sft": "after SFT", "rl": "after RL"}
        lines += ["", "held-out eval per checkpoint (mean reward; pass@k):"]
        for result in [*results["evaluate"].get("compared", []), results["evaluate"]]:
            metrics = result.get("metrics", {})
            name = label.get(produced_by.get(metrics.get("checkpoint", "")), "")
            for dataset, figures in metrics.get("datasets", {}).items():
                shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(figures.items())
                                  if k == "mean_reward" or k.startswith("pass@"))
                lines.append(f"  {name:<20} {dataset}: {shown}   {metrics['checkpoint']}")
    if "rl" in results:
        m = results["rl"]["metrics"]
        overhead = m.get("prefect_s_per_iteration")  # none when `slime rl` made the stage
        overhead = "" if overhead is None else f", Prefect overhead {overhead} s/iteration"
        lines.append(f"\nrl: iterations {m['start_rollout_id']}..{m['num_rollout'] - 1}, last reward mean "
                     f"{m['reward_mean_last']}{overhead}, metrics {m['metrics_uri']}")
    if "export" in results:
        lines.append(f"exported HF model: {results['export']['artifacts']['hf_model']['uri']} "
                     "(transformers.AutoModelForCausalLM.from_pretrained loads it)")
    for dataset, check in results.get("export", {}).get("answers_check", {}).items():
        lines.append(f"  loaded with transformers, it answers {check['same_answer']}/{check['prompts']} '{dataset}' "
                     f"prompts as the evaluate stage scored them (accuracy {check['accuracy_exported']:.4f})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(pipeline, describe=describe))
