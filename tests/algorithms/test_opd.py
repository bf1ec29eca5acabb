"""apply_opd_kl: A' = A - coef * (student - teacher) per token, by hand; a teacher equal to the student changes
nothing; mismatched spans are refused."""

import pytest
import torch

from slime.algorithms.opd import apply_opd_kl


def test_penalty_is_coef_times_student_minus_teacher():
    adv = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([-0.5, -0.5])]
    student = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0, -1.0])]
    teacher = [torch.tensor([-2.0, -2.0, -0.25]), torch.tensor([-1.0, -4.0])]
    new, kl = apply_opd_kl(adv, student, teacher, kl_coef=0.5)
    # reverse KL = student - teacher: [1, 0, -0.25] and [-2, 3]
    torch.testing.assert_close(kl[0], torch.tensor([1.0, 0.0, -0.25]))
    torch.testing.assert_close(kl[1], torch.tensor([-2.0, 3.0]))
    # A - 0.5 * kl: [1 - 0.5, 1 - 0, 1 + 0.125] and [-0.5 + 1, -0.5 - 1.5]
    torch.testing.assert_close(new[0], torch.tensor([0.5, 1.0, 1.125]))
    torch.testing.assert_close(new[1], torch.tensor([0.5, -2.0]))


def test_teacher_equal_to_student_leaves_advantages():
    adv = [torch.tensor([0.3, -0.7])]
    logp = [torch.tensor([-1.2, -0.4])]
    new, kl = apply_opd_kl(adv, logp, [logp[0].clone()], kl_coef=2.0)
    assert torch.equal(new[0], adv[0]) and torch.equal(kl[0], torch.zeros(2))


def test_mismatched_spans_are_refused():
    with pytest.raises(ValueError, match="sample 0"):
        apply_opd_kl([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(2)], kl_coef=1.0)
    with pytest.raises(ValueError, match="2 advantage rows"):
        apply_opd_kl([torch.zeros(3)] * 2, [torch.zeros(3)], [torch.zeros(3)], kl_coef=1.0)
