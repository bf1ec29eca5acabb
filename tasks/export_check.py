"""Task `check-export`: the exported HF directory, loaded with plain transformers, answers the greedy eval
prompts as the evaluate stage scored them (`slime.stages.export_check`). Cheap and never cached: it reads two
committed artifacts and proves they agree."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from slime.config import Config
from slime.stages.export_check import check_exported_answers


@task(name="check-export", task_run_name="check-export-{run_id}")
def check_export(config: Config, run_id: str, hf_dir: str, eval_result: str, datasets: list[str]) -> dict[str, Any]:
    """One comparison per greedy eval dataset; a disagreement is logged with its first prompts."""
    logger = get_run_logger()
    out = {}
    for name in datasets:
        check = check_exported_answers(config, hf_dir, eval_result, name)
        out[name] = check
        line = (f"exported model on {name}: {check['same_answer']}/{check['prompts']} answers as evaluated, "
                f"accuracy {check['accuracy_exported']:.4f} (evaluate stage: {check['accuracy_eval']:.4f})")
        if check["same_answer"] == check["prompts"]:
            logger.info(line)
        else:
            logger.warning("%s; first differences: %s", line, check["mismatches"])
    return out
