"""What users see in the Prefect UI: a markdown report per stage, links to exported models, and the
pipeline's stage table. Artifact keys are `<run id>-<stage>-...` (lowercase, dashes)."""

from __future__ import annotations

import json
import re
from typing import Any

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from slime.config import Config


def artifact_key(*parts: str) -> str:
    """An artifact key from free text: lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower())).strip("-")


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return f"`{text}`" if text else "``"


def _file_link(uri: str) -> str:
    return uri if "://" in uri else f"file://{uri}"


def stage_markdown(summary: dict[str, Any], config: Config, config_fields: tuple[str, ...]) -> str:
    """The stage report: status, artifacts, metrics, time per phase, inputs and the config in its cache key."""
    stage, run_id = summary["stage"], summary["run_id"]
    seconds = summary.get("seconds", {})
    if summary["status"] == "cached":
        status = ("**reused** from stored artifacts (Prefect state Cached): nothing was recomputed; "
                  "metrics and times below are from the run that produced them")
    else:
        status = f"**ran** in {sum(seconds.values()):.1f} s"
    lines = [f"# {stage} - run `{run_id}`", "", status, "", "## Artifacts", "",
             "| name | URI | manifest sha256 |", "|---|---|---|"]
    lines += [f"| {name} | [{a['uri']}]({_file_link(a['uri'])}) | `{a['manifest_hash'][:16]}...` |"
              for name, a in summary["artifacts"].items()]
    if summary.get("metrics"):
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_value(v)} |" for k, v in summary["metrics"].items()]
    for figure in summary.get("figures", []):
        lines += ["", f"## {figure['title']}", "", figure.get("caption", ""), "",
                  f"![{figure['title']}]({figure['embed']})" if figure.get("embed") else "",
                  f"[{figure['uri']}]({_file_link(figure['uri'])})"]
    lines += ["", "## Time per phase", "", "| phase | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in seconds.items()]
    lines += ["", "## Inputs", "", "| role | URI |", "|---|---|"]
    lines += [f"| {role} | `{uri}` |" for role, uri in summary.get("inputs", {}).items()]
    dump = config.model_dump(mode="json")
    lines += ["", "## Configuration in the cache key", "", "| field | value |", "|---|---|"]
    for selector in config_fields:
        section, _, name = selector.partition(".")
        lines.append(f"| {selector} | {_value(dump[section][name] if name else dump[section])} |")
    lines += ["", f"store `{config.run.store}`"]
    return "\n".join(lines)


def publish_stage_report(summary: dict[str, Any], config: Config, config_fields: tuple[str, ...]) -> None:
    """Markdown report of a stage run, plus a link artifact for every exported HF model."""
    stage, run_id = summary["stage"], summary["run_id"]
    create_markdown_artifact(stage_markdown(summary, config, config_fields),
                             key=artifact_key(run_id, stage, "report"),
                             description=f"{stage} of run {run_id}: {summary['status']}")
    for name, artifact in summary["artifacts"].items():
        if name == "hf_model":
            create_link_artifact(_file_link(artifact["uri"]), link_text=artifact["uri"],
                                 key=artifact_key(run_id, stage, name),
                                 description=f"HF model exported by run {run_id} (loads with transformers/SGLang)")


def publish_eval_table(run_id: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per evaluated checkpoint and dataset: the eval metrics (mean reward, pass@k, ...), keyed by the
    checkpoint and, for an RL checkpoint, the rollout id it was saved after and its weight version (the key of
    the RL loop's own evals, so a scheduled eval of a running run lines up with them)."""
    rows = []
    for result in results:
        m = result["metrics"]
        for dataset, figures in m["datasets"].items():
            rows.append({"rollout_id": m.get("rollout_id"), "weight_version": m.get("weight_version"),
                         "checkpoint": m["checkpoint"], "dataset": dataset,
                         **{k: round(v, 6) if isinstance(v, float) else v for k, v in sorted(figures.items())},
                         "status": result["status"]})
    if rows:
        create_table_artifact(rows, key=artifact_key(run_id, "evaluate", "results"),
                              description=f"eval results of run {run_id}, per checkpoint and dataset")
    return rows


def publish_pipeline_table(run_id: str, rows: list[dict[str, Any]]) -> None:
    """One row per pipeline stage: ran, cached, skipped or not completed."""
    create_table_artifact(rows, key=artifact_key(run_id, "stages"), description=f"stages of run {run_id}")
