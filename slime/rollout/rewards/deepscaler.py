"""`rm_type: deepscaler`: DeepScaleR's rule for reasoning models, as slime's `rm_hub` applies it.

The response must close its reasoning (`</think>`, or contain slime's `###Response` marker); the solution
after it must hold a `\\boxed{}` answer, which is graded against the label. Anything else scores 0.
Grading uses math-verify (see `math_rm`) where slime uses DeepScaleR's mathd + sympy graders.
"""

from __future__ import annotations

from typing import Any

from slime.rollout.rewards.boxed import last_boxed
from slime.rollout.rewards.math_rm import is_equivalent


def deepscaler_reward(response: str, label: Any) -> float:
    """1.0 when the boxed answer after the reasoning equals the label, else 0.0."""
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[-1]
    elif "###Response" in response:
        solution = response.split("###Response", 1)[1]
    else:
        return 0.0  # reasoning never closed: no final answer
    answer = last_boxed(solution)
    if answer is None or label is None or str(label) == "":
        return 0.0
    return 1.0 if is_equivalent(answer, label) else 0.0
