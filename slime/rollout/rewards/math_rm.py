"""`rm_type: math` (slime's) and `rm_type: math_verify` (lenient): 1.0 for a right final answer, else 0.0.

`math` is slime's `grade_answer_verl`: the answer is the content of the response's last `\\boxed{}`
(no box, no reward); a boxed label is unboxed; the two match when Hendrycks' MATH normalisation makes
them the same string (`hendrycks`) or DeepScaleR's sympy grader shows them equal (`sympy_grader`).
One departure: a numeric label 0 is graded (slime's `if not ground_truth` gives every answer 0 for it).

`math_verify` also reads an unboxed answer: without a box the whole response goes to Hugging Face's
math-verify, which finds the final answer in it ("19<|im_end|>", how the tiny arithmetic kit answers);
with boxes (`\\boxed{}`, `\\fbox{}`, `\\boxed 5`), the last one is the answer. The label is read as LaTeX
(math-verify reads `\\sqrt{8}` or `\\frac34` only inside math delimiters or a box, so a label without
delimiters is read as `\\boxed{label}`), and where math-verify says no, slime's two graders above still
may say yes. math-verify is more lenient than slime's graders: it takes `\\frac{2}{4}` for `1/2` and
`\\sqrt{16}` for `4`.

Everything that runs sympy runs in the grading process (`grading_process`): one answer that takes more
than GRADE_TIMEOUT_S scores 0 (logged), from any thread.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from math_verify import parse, verify

from slime.rollout.rewards.boxed import boxed_answer, last_boxed
from slime.rollout.rewards.grading_process import GradingTimeout, call_with_timeout
from slime.rollout.rewards.hendrycks import mathd_equal
from slime.rollout.rewards.sympy_grader import sympy_equal

logger = logging.getLogger(__name__)

# dotted paths of the functions the grading process runs
_SYMPY_EQUAL = f"{sympy_equal.__module__}.{sympy_equal.__name__}"
_MATH_VERIFY_EQUAL = f"{__name__}.math_verify_equal"


def slime_label(label: Any) -> str | None:
    """The label as slime's math graders read it: its string, unboxed; None when there is none.

    A number is always a label (slime's `if not ground_truth` drops 0 and 0.0, a departure here)."""
    numeric = isinstance(label, int | float) and not isinstance(label, bool)
    if not numeric and not label:
        return None
    text = str(label)
    return boxed_answer(text) if "\\boxed" in text else text


def _graded_in_child(fn: str, *args: str | None) -> bool:
    """`fn(*args)` in the grading process; a grading that runs out of time is a wrong answer."""
    try:
        return bool(call_with_timeout(fn, list(args)))
    except GradingTimeout as exc:
        logger.warning("scored 0: %s (answer %.200r, label %.200r)", exc, args[0], args[1])
        return False


@functools.lru_cache(maxsize=1 << 16)  # the n samples of a prompt share its label; policies repeat answers
def answers_match(answer: str, truth: str) -> bool:
    """slime's test of an extracted answer against a label: MATH normalisation, then sympy."""
    return mathd_equal(answer, truth) or _graded_in_child(_SYMPY_EQUAL, answer, truth)


def math_reward(response: str, label: Any) -> float:
    """slime's `math`: 1.0 when the last `\\boxed{}` answer matches the label, else 0.0."""
    truth = slime_label(label)
    answer = boxed_answer(response or "")
    if truth is None or answer is None:
        return 0.0
    return 1.0 if answers_match(answer, truth) else 0.0


def _as_latex(text: str) -> str:
    """`text` as math-verify reads LaTeX: inside `\\boxed{}`, unless it has its own math delimiters."""
    delimited = re.search(r"(?<!\\)\$|\\\(|\\\[", text)
    return text if delimited else f"\\boxed{{{text}}}"


def math_verify_equal(answer_text: str, gold_text: str, boxed: str | None) -> bool:
    """math-verify's verdict, then slime's sympy grader's (runs in the grading process).

    math-verify searches `answer_text` for the final answer (a boxed answer comes in as
    `\\boxed{content}`); `gold_text`, the label, is read as LaTeX first and as plain text when that finds
    nothing. The sympy grader compares the box's content, or the whole response when there is no box.
    """
    # the grading process runs this on its main thread, where math-verify's own SIGALRM limits work
    gold = parse(_as_latex(gold_text)) or parse(gold_text)
    answer = parse(answer_text)
    if gold and answer and verify(gold, answer):
        return True
    return sympy_equal(answer_text if boxed is None else boxed, gold_text)


@functools.lru_cache(maxsize=1 << 16)
def _lenient_match(response: str, gold_text: str) -> bool:
    boxed = last_boxed(response)
    if boxed is not None and mathd_equal(boxed, gold_text):
        return True
    answer_text = response if boxed is None else f"\\boxed{{{boxed}}}"
    return _graded_in_child(_MATH_VERIFY_EQUAL, answer_text, gold_text, boxed)


def math_verify_reward(response: str, label: Any) -> float:
    """The lenient `math_verify`: 1.0 when the final answer, boxed or not, equals the label, else 0.0."""
    if label is None or response is None:
        return 0.0
    gold = str(label)
    if "\\boxed" in gold or "\\fbox" in gold:
        gold = last_boxed(gold) or gold
    if not gold.strip():
        return 0.0
    return 1.0 if _lenient_match(response, gold) else 0.0
