"""Flow `post-training`: the whole pipeline, one stage flow per line, over one run of the store.

    python -m flows.pipeline --config deployments/tiny-cpu.yaml [--store URL] [--run-id ID] [--flag value ...]

Each stage reads its input from the previous stage's committed artifact and writes to
`{store}/{run_id}/{stage}/`. A stage whose inputs and config are unchanged is reused (Prefect state
Cached, nothing recomputed); a re-run of a failed pipeline (same parameters, or `prefect flow-run
retry`) therefore continues at the failed stage. Stages that are not built yet are listed as such
in the stage table, never run or faked. Adding a stage: a task module, a flow, one line below.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger

from flows._cli import DEFAULT_CONFIG, main
from flows._report import publish_pipeline_table
from flows._stage import resolve_run, run_name
from flows.convert import convert_flow
from flows.export import export_flow
from flows.sft import sft_flow

# DESIGN.md's stage order; the ones without a flow yet are reported as "not built yet"
STAGE_ORDER = ("convert", "sft", "rejection_sampling", "rl", "evaluate", "export")
NOT_BUILT = ("rejection_sampling", "rl", "evaluate")


def checkpoint_of(result: dict[str, Any]) -> str:
    return result["artifacts"]["checkpoint"]["uri"]


@flow(name="post-training", flow_run_name=run_name("post-training"))
def pipeline(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, store: str | None = None,
             run_id: str | None = None) -> dict[str, dict[str, Any]]:
    """convert -> sft -> (rejection_sampling -> rl -> evaluate: not built yet) -> export."""
    _, run_id = resolve_run(config, overrides, store, run_id)
    common = {"config": config, "overrides": overrides, "store": store, "run_id": run_id}
    results: dict[str, dict[str, Any]] = {}
    try:
        results["convert"] = convert_flow(**common)
        results["sft"] = sft_flow(**common, model=checkpoint_of(results["convert"]))
        # rejection_sampling, rl and evaluate land here, each taking `model` and returning a checkpoint
        results["export"] = export_flow(**common, model=checkpoint_of(results["sft"]))
    finally:
        publish_pipeline_table(run_id, stage_rows(results))
        logger = get_run_logger()
        for row in stage_rows(results):
            logger.info("%-18s %s %s", row["stage"], row["status"], row["artifact"])
    return results


def stage_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per stage of DESIGN.md's pipeline: ran, cached, not built yet, or not completed."""
    rows = []
    for stage in STAGE_ORDER:
        result = results.get(stage)
        if result is not None:
            status = result["status"]
            artifact = ", ".join(a["uri"] for a in result["artifacts"].values())
            seconds = round(sum(result.get("seconds", {}).values()), 2)
        else:
            status = "not built yet" if stage in NOT_BUILT else "not completed"
            artifact, seconds = "", None
        rows.append({"stage": stage, "status": status, "artifact": artifact, "seconds": seconds})
    return rows


def describe(results: dict[str, dict[str, Any]]) -> str:
    """The stage table as text: what ran, what was reused, where the artifacts are."""
    lines = [f"{'stage':<19}{'status':<15}artifact"]
    lines += [f"{r['stage']:<19}{r['status']:<15}{r['artifact']}" for r in stage_rows(results)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(pipeline, describe=describe))
