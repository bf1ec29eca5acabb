"""`rm_type: dapo`: the DAPO-Math rule (Minerva-style answer matching), as slime's `rm_hub` applies it.

Only the last 300 characters of the response are read (the longest MATH-500 answer has 159). The last
`Answer: ...` line is the prediction; prediction and label are normalised the Minerva way (text after
the last `=`, units and TeX decoration removed, the first `$...$` kept, `\\text{}`/`\\boxed{}` unwrapped,
thousands separators dropped) and compared as strings, the label in its integer spelling ("12.0" ->
"12"): DAPO labels are integers. The reward is a dict, `{"score": 1.0 | -1.0, "acc": bool, "pred": str}`;
train on it with `reward_key: score`.

Departure from slime, which raises ValueError for any label that is not a number and truncates one that
is not integral (`0.5` becomes `0`, so an answer `0` scores and `0.5` does not): such labels are compared
in their normalised spelling. A missing or empty label is a data error, as in slime.
"""

from __future__ import annotations

import math
import re
from typing import Any

from slime.errors import DataFormatError

_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_TAIL_CHARS = 300

# Plain-text replacements (order matters: articles before spaces).
_REPLACE = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
# Units, filler words and TeX spacing that never change the value of an answer.
_DROP = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
         "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
         "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
         "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
         r",\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>"]
_FIRST_INLINE_MATH = re.compile(r"(.*?)\$(.*?)\$(.*)")  # per line: keep `$x$` of `... $x$ ...`
_UNWRAP = [re.compile(rf"\\{cmd}\{{(.*?)\}}") for cmd in ("text", "textbf", "overline")]
_UNBOX = re.compile(r"\\boxed\{(.*)\}")  # greedy: the first `\boxed{` to the last `}`


def normalize_answer(answer: Any) -> str:
    """Minerva normalisation of a final answer string."""
    text = str(answer).split("=")[-1]
    for old, new in _REPLACE:
        text = text.replace(old, new)
    for word in _DROP:
        text = text.replace(word, "")
    text = _FIRST_INLINE_MATH.sub(r"$\2$", text)
    for pattern in [*_UNWRAP, _UNBOX]:
        text = pattern.sub(r"\1", text)
    # shorthand TeX: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}
    text = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", text)
    text = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def _gold(label: Any) -> str:
    """The normalised label, in integer spelling when it is an integral number."""
    if label is None or str(label).strip() == "":
        raise DataFormatError(f"rm_type dapo needs a label (an integer answer); got {label!r}")
    gold = normalize_answer(label)
    try:
        value = float(gold)
    except ValueError:
        return gold
    return str(int(value)) if math.isfinite(value) and value.is_integer() else gold


def dapo_reward(response: str, label: Any) -> dict[str, Any]:
    """{"score": 1.0 if the last `Answer:` matches the label else -1.0, "acc": bool, "pred": str}."""
    gold = _gold(label)
    matches = _ANSWER.findall((response or "")[-_TAIL_CHARS:])
    pred = normalize_answer(matches[-1] if matches else "[INVALID]")
    correct = bool(matches) and pred == gold
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
