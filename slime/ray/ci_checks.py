"""slime's `--ci-test` invariants, checked on the metrics a run logs anyway, so a broken run fails at the
step that shows the break instead of training on.

The checks (slime: `backends/megatron_utils/model.py`, `observability/train_metric_utils.py`):

* every rollout: `train/train_rollout_logprob_abs_diff` (mean |trainer - engine| log-prob of the rollout's
  tokens) <= `ci_train_rollout_logprob_abs_diff_threshold`: the engines serve the trainer's weights;
* KL checker (off with `ci_disable_kl_checker`):
  - first optimizer step of every rollout: `ppo_kl` < 1e-8 (the policy has not moved since the old
    log-probs were computed); skipped with `use_rollout_logprobs`, where the old log-probs are the engine's
    and their gap is the check above;
  - first step of the run (rollout 0): `kl_loss` < 1e-8 (actor and reference start equal);
  - rollout 0: `rollout/kl` < 1e-8 (slime compares rollout/log_probs with rollout/ref_log_probs);
* `ci_save_grad_norm` / `ci_load_grad_norm` (slime's path templates with `{role}`, `{rollout_id}`,
  `{step_id}`): save each step's grad norm, or compare it with a saved one (rel/abs tolerance 0.01). Files
  are JSON here (slime: torch.save).

Failures raise `InvariantError`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from slime.errors import InvariantError

KL_BOUND = 1e-8  # slime's bound: the quantities are exactly zero up to float rounding
GRAD_NORM_TOLERANCE = 0.01  # slime's rel_tol and abs_tol


def ci_failures(settings: Any, rollout_id: int, first_step: dict[str, float], metrics: dict[str, float]) -> list[str]:
    """What breaks slime's invariants in one rollout's train metrics ([] when all hold).

    settings: the config's flat fields (`Config.as_namespace()` or any object with them);
    first_step: the first optimizer step's values (ppo_kl, kl_loss, ...); metrics: the rollout's logged
    metrics (`train/train_rollout_logprob_abs_diff`, `rollout/kl`).
    """
    problems = []
    threshold = settings.ci_train_rollout_logprob_abs_diff_threshold
    gap = metrics.get("train/train_rollout_logprob_abs_diff")
    if gap is not None and not gap <= threshold:
        problems.append(f"train/train_rollout_logprob_abs_diff = {gap:.3g} > {threshold:g} "
                        "(--ci-train-rollout-logprob-abs-diff-threshold): the engines do not sample from the "
                        "trainer's weights")
    if settings.ci_disable_kl_checker:
        return problems
    ppo_kl = first_step.get("ppo_kl")
    if ppo_kl is not None and not settings.use_rollout_logprobs and not abs(ppo_kl) < KL_BOUND:
        problems.append(f"train/ppo_kl of the first step = {ppo_kl:.3g}, not below {KL_BOUND:g}: the policy "
                        "moved before its first optimizer step")
    if rollout_id == 0:
        kl_loss = first_step.get("kl_loss")
        if kl_loss is not None and not abs(kl_loss) < KL_BOUND:
            problems.append(f"train/kl_loss of the run's first step = {kl_loss:.3g}, not below {KL_BOUND:g}: "
                            "actor and reference differ at the start")
        kl = metrics.get("rollout/kl")
        if kl is not None and not abs(kl) < KL_BOUND:
            problems.append(f"rollout/kl at rollout 0 = {kl:.3g}, not below {KL_BOUND:g}: actor and reference "
                            "log-probs differ at the start")
    return problems


def check_ci(settings: Any, rollout_id: int, first_step: dict[str, float], metrics: dict[str, float]) -> None:
    """Raise `InvariantError` naming every broken invariant of rollout `rollout_id`."""
    problems = ci_failures(settings, rollout_id, first_step, metrics)
    if problems:
        raise InvariantError(f"--ci-test: rollout {rollout_id}: " + "; ".join(problems))


def _grad_norm_path(template: str, rollout_id: int, step_id: int) -> Path:
    return Path(template.format(role="actor", rollout_id=rollout_id, step_id=step_id))


def save_grad_norms(template: str, rollout_id: int, grad_norms: list[float]) -> None:
    """`--ci-save-grad-norm`: one JSON file per optimizer step of the rollout."""
    for step_id, value in enumerate(grad_norms):
        path = _grad_norm_path(template, rollout_id, step_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"grad_norm": value}))


def check_grad_norms(template: str, rollout_id: int, grad_norms: list[float]) -> None:
    """`--ci-load-grad-norm`: each step's grad norm equals the saved one within slime's tolerance."""
    for step_id, value in enumerate(grad_norms):
        path = _grad_norm_path(template, rollout_id, step_id)
        if not path.is_file():
            raise InvariantError(f"--ci-load-grad-norm: no saved grad norm at {path} (rollout {rollout_id}, step "
                                 f"{step_id})")
        expected = json.loads(path.read_text())["grad_norm"]
        if not math.isclose(value, expected, rel_tol=GRAD_NORM_TOLERANCE, abs_tol=GRAD_NORM_TOLERANCE):
            raise InvariantError(f"--ci-load-grad-norm: rollout {rollout_id} step {step_id}: grad norm {value:.6g} "
                                 f"!= saved {expected:.6g} ({path})")
