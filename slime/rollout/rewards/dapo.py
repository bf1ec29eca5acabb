"""`rm_type: dapo`: the DAPO-Math rule (Minerva-style answer matching), as slime's `rm_hub` applies it.

Only the last 300 characters of the response are read (the longest MATH-500 answer has 159). The last
`Answer: ...` line is the prediction; prediction and label are normalised the Minerva way (text after
the last `=`, units and TeX decoration removed, thousands separators dropped) and compared as strings.
DAPO labels are integers, so an integral label is compared in its integer spelling ("12.0" -> "12").
The reward is a dict, `{"score": 1.0 | -1.0, "acc": bool, "pred": str}`; train on it with
`reward_key: score`.
"""

from __future__ import annotations

import re
from typing import Any

from slime.rollout.rewards.boxed import last_boxed

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
_UNWRAP = [re.compile(rf"\\{cmd}\{{(.*?)\}}") for cmd in ("text", "textbf", "overline")]


def normalize_answer(answer: str) -> str:
    """Minerva normalisation of a final answer string."""
    text = str(answer).split("=")[-1]
    for old, new in _REPLACE:
        text = text.replace(old, new)
    for word in _DROP:
        text = text.replace(word, "")
    inline_math = re.search(r"\$(.*?)\$", text)
    if inline_math:
        text = inline_math.group(1)
    for pattern in _UNWRAP:
        text = pattern.sub(r"\1", text)
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    # shorthand TeX: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}
    text = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", text)
    text = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def _integer_spelling(label: str) -> str:
    """'12.0' -> '12'; anything that is not an integral number stays as it is."""
    try:
        value = float(label)
    except ValueError:
        return label
    return str(int(value)) if value.is_integer() else label


def dapo_reward(response: str, label: Any) -> dict[str, Any]:
    """{"score": 1.0 if the last `Answer:` matches the label else -1.0, "acc": bool, "pred": str}."""
    matches = _ANSWER.findall(response[-_TAIL_CHARS:])
    pred = normalize_answer(matches[-1]) if matches else "[INVALID]"
    gold = str(label) if label is not None else ""
    if "\\boxed" in gold:
        gold = last_boxed(gold) or gold
    gold = _integer_spelling(normalize_answer(gold))
    correct = bool(matches) and gold != "" and pred == gold
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
