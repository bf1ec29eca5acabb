"""On-policy distillation (OPD): a teacher's per-token log-probs as a penalty on the student's advantages.

The student generates (the normal rollout); a frozen teacher scores the student's response tokens; for each
response token t the sampled reverse KL estimate is

    reverse_kl_t = log pi_student(y_t) - log pi_teacher(y_t)
    A'_t         = A_t - opd_kl_coef * reverse_kl_t

on top of whichever estimator gave A (slime's `apply_opd_kl_to_advantages`, after the estimator and before
advantage whitening; the recipe of the Tinker cookbook's on-policy distillation). Every response position is
penalised; the loss mask decides later which of them are trained. Pure torch: lists of 1-D per-sample tensors in,
the same out.
"""

from __future__ import annotations

import torch


def apply_opd_kl(advantages: list[torch.Tensor], student_log_probs: list[torch.Tensor],
                 teacher_log_probs: list[torch.Tensor], kl_coef: float
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(new advantages, per-token reverse KL) for per-sample `[T_i]` float tensors of equal lengths.

    Raises ValueError naming the sample whose three lengths differ (a teacher that scored another span)."""
    if not len(advantages) == len(student_log_probs) == len(teacher_log_probs):
        raise ValueError(f"OPD: {len(advantages)} advantage rows, {len(student_log_probs)} student and "
                         f"{len(teacher_log_probs)} teacher log-prob rows")
    out, reverse_kls = [], []
    for i, (adv, student, teacher) in enumerate(zip(advantages, student_log_probs, teacher_log_probs, strict=True)):
        if not adv.shape == student.shape == teacher.shape:
            raise ValueError(f"OPD: sample {i}: advantages {tuple(adv.shape)}, student log-probs "
                             f"{tuple(student.shape)} and teacher log-probs {tuple(teacher.shape)} differ")
        reverse_kl = student.float() - teacher.float()
        out.append(adv.float() - kl_coef * reverse_kl)
        reverse_kls.append(reverse_kl)
    return out, reverse_kls
