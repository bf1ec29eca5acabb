"""Hendrycks' MATH answer normalisation ("mathd"): the string check slime's math graders try first.

Two answers are equal when their normalised strings are. The normalisation is the one of the MATH
benchmark (Hendrycks et al. 2021), as DeepScaleR and slime's `rm_hub.math_utils` apply it, rule for
rule, so that a label and an answer compare here as they do in slime:

* an answer that is wholly `\\text{...}` is unwrapped; newlines, `\\!`, `\\left`, `\\right`, degree
  marks, `\\$` and `\\%` are dropped; `\\\\` becomes `\\`; `\\dfrac`/`\\tfrac` become `\\frac`;
* a unit after `\\text{ ` (with its space) is cut off; a leading `.` gets its 0 (`.5` -> `0.5`);
* `k = 5` (a name of at most two characters) becomes `5`;
* `\\sqrt2` -> `\\sqrt{2}`, `\\frac12` -> `\\frac{1}{2}`, `0.5` -> `\\frac{1}{2}`, `3/4` -> `\\frac{3}{4}`;
  spaces are removed after the `\\sqrt` fix, so `\\sqrt 2` becomes `\\sqrt{}2` here (the sympy grader,
  tried next, still reads it as sqrt(2)).

A normalisation step that cannot apply (two `\\text{ ` units, a trailing `\\sqrt` or `\\frac`) leaves
the (unwrapped) answer as it was, as in the original.
"""

from __future__ import annotations

import re

_TEXT_ONLY = re.compile(r"^\\text\{(?P<text>.+?)\}$")
# Removed outright, in this order (`\\left` before `\\right` matters only for `\\leftright`).
_DROP = ["\n", "\\!"]
_DROP_LATER = ["\\left", "\\right", "^{\\circ}", "^\\circ", "\\$"]


class _Unnormalisable(Exception):
    """A step met a shape it cannot handle; the answer is compared unnormalised."""


def _cut_units(text: str) -> str:
    """`5\\text{ cm}` -> `5`: a `\\text{ ` (with a space) holds units; more than one is not handled."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise _Unnormalisable
    return parts[0]


def _brace_sqrt(text: str) -> str:
    """`\\sqrt2` -> `\\sqrt{2}`: the one character after a brace-less `\\sqrt` becomes its argument."""
    head, *rest = text.split("\\sqrt")
    out = [head]
    for piece in rest:
        if not piece:
            raise _Unnormalisable  # `\\sqrt` at the very end
        out.append("\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:]))
    return "".join(out)


def _brace_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`; a too-short one leaves `text` as is."""
    head, *rest = text.split("\\frac")
    out = [head]
    for piece in rest:
        if not piece:
            raise _Unnormalisable  # `\\frac` at the very end
        if piece[0] == "{":
            out.append("\\frac" + piece)
            continue
        if len(piece) < 2:
            return text
        numerator, second, tail = piece[0], piece[1], piece[2:]
        if second == "{":
            out.append("\\frac{" + numerator + "}{" + tail)
        else:
            out.append("\\frac{" + numerator + "}{" + second + "}" + tail)
    return "".join(out)


def _slash_to_frac(text: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are integers written plainly."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _strip(text: str) -> str:
    for token in _DROP:
        text = text.replace(token, "")
    text = text.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    for token in _DROP_LATER:
        text = text.replace(token, "")
    text = _cut_units(text).replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5", "x=3": the value only
        text = sides[1]
    text = _brace_sqrt(text).replace(" ", "")
    text = _brace_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_frac(text)


def mathd_normalize(answer: str | None) -> str | None:
    """The MATH-normalised form of `answer` (None stays None)."""
    if answer is None:
        return None
    answer = answer.strip()
    match = _TEXT_ONLY.search(answer)
    if match is not None:
        answer = match.group("text").strip()
    try:
        return _strip(answer)
    except _Unnormalisable:
        return answer


def mathd_equal(given: str | None, truth: str | None) -> bool:
    """Whether `given` and `truth` normalise to the same string."""
    return mathd_normalize(truth) == mathd_normalize(given)
