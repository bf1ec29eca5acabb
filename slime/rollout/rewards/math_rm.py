"""`rm_type: math`: 1.0 when the response's final answer equals the label mathematically, else 0.0.

Equivalence is decided by Hugging Face's `math-verify` (LaTeX and plain expressions, `1/2` = `0.5` =
`\\frac{1}{2}`, sets, intervals), not by hand-written normalisation. Departure from slime, whose `math`
grader needs a `\\boxed{}` answer: without a box the whole response is read by math-verify, so a bare
final answer ("19<|im_end|>", what the tiny arithmetic kit's SFT data teaches) is graded; with boxes,
only the last box is.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from math_verify import parse, verify

from slime.rollout.rewards.boxed import last_boxed

# math-verify's time limits use SIGALRM, which only the main thread may set; elsewhere (Prefect task
# threads, Ray actor threads) parsing runs without a limit rather than failing.
_TIMEOUT_S = 5


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_answer(text: str) -> list[Any]:
    """math-verify's parse of `text`: [] when no answer can be read from it."""
    return parse(text, parsing_timeout=_timeout())


def is_equivalent(response: str, label: Any) -> bool:
    """Whether the final answer in `response` equals `label` (a string or number; a boxed label is unboxed)."""
    if label is None or response is None:
        return False
    gold_text = str(label)
    if "\\boxed" in gold_text or "\\fbox" in gold_text:
        gold_text = last_boxed(gold_text) or gold_text
    if not gold_text.strip():
        return False
    # Like slime, a boxed answer is the answer (the last box when there are several); math-verify
    # would otherwise read every box at once.
    boxed = last_boxed(response)
    return _equivalent_texts(response if boxed is None else boxed, gold_text)


# Parsing costs ~1 ms per string (sympy); the n samples of a prompt share its label and a trained
# policy repeats its answers, so results are cached by the two strings.
@functools.lru_cache(maxsize=1 << 16)
def _equivalent_texts(answer_text: str, gold_text: str) -> bool:
    gold, answer = _parse_gold(gold_text), parse_answer(answer_text)
    if not gold or not answer:
        return False
    return verify(gold, answer, timeout_seconds=_timeout())


@functools.lru_cache(maxsize=1 << 14)
def _parse_gold(gold_text: str) -> list[Any]:
    return parse_answer(gold_text)


def math_reward(response: str, label: Any) -> float:
    """1.0 for a correct final answer, 0.0 otherwise (wrong, missing or unparsable)."""
    return 1.0 if is_equivalent(response, label) else 0.0
