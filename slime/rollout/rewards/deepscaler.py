"""`rm_type: deepscaler`: DeepScaleR's rule for reasoning models, as slime's `rm_hub.deepscaler` applies it.

The solution is what follows the last `</think>` (else what lies between the first `###Response` and the
next one); a response with neither scores 0. The solution's last `\\boxed{}` is the answer (none: 0),
graded against the label (a boxed label is unboxed) as `math` grades it: MATH normalisation, then
DeepScaleR's sympy grader. An empty label scores 0. A label that is not a string or a number is a data
error (slime asserts it).
"""

from __future__ import annotations

from typing import Any

from slime.errors import DataFormatError
from slime.rollout.rewards.boxed import boxed_answer
from slime.rollout.rewards.math_rm import answers_match


def _solution(response: str) -> str | None:
    if "</think>" in response:
        return response.rsplit("</think>", 1)[-1]
    if "###Response" in response:
        return response.split("###Response")[1]
    return None  # reasoning never closed: no final answer


def deepscaler_reward(response: str, label: Any) -> float:
    """1.0 when the boxed answer after the reasoning equals the label, else 0.0."""
    solution = _solution(response or "")
    answer = None if solution is None else boxed_answer(solution)
    if answer is None or (isinstance(label, str) and label == ""):
        return 0.0
    if not isinstance(label, str | int | float):
        raise DataFormatError(f"rm_type deepscaler: the label must be a string or a number, not "
                              f"{type(label).__name__} {label!r}")
    truth = str(label)
    if "\\boxed" in truth:
        truth = boxed_answer(truth)
        if truth is None:
            return 0.0
    return 1.0 if answers_match(answer, truth) else 0.0
