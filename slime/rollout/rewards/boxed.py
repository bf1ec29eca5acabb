"""Find the last boxed answer in a response, honouring nested braces.

The math graders look only at the final boxed answer: a model may box intermediate results, the last
box is the answer. Two readings:

* `boxed_answer`: slime's (`rm_hub.math_utils.extract_boxed_answer`), used by `math`, `deepscaler` and
  the `boxed_` prefix: the last `\\boxed` must be `\\boxed{...}` and closed, else there is no answer
  (`\\boxed{5} ... \\boxed 7` has none; `\\fbox{5}` alone has none).
* `last_boxed`: the lenient one of `math_verify`, which also reads `\\fbox{...}` and `\\boxed 5`.
"""

from __future__ import annotations

_OPENERS = ("\\boxed{", "\\fbox{")


def boxed_answer(text: str) -> str | None:
    """Content of the last `\\boxed{...}` when the last `\\boxed` of `text` opens a closed brace, else None."""
    start = text.rfind("\\boxed") if text else -1
    if start < 0 or not text.startswith("\\boxed{", start):
        return None
    return _closed(text, start + len("\\boxed{"))


def _closed(text: str, begin: int) -> str | None:
    """`text[begin:end]` where `end` is the brace closing the one just before `begin`; None if unclosed."""
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None  # an unclosed box (truncated response): no answer


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, or None when there is none or it is unclosed.

    `\\boxed 5` (the brace-less form some models write) counts too: its content runs to the next space
    or `$`.
    """
    if not text:
        return None
    start, opener = max(((text.rfind(o), o) for o in _OPENERS), key=lambda pair: pair[0])
    bare = text.rfind("\\boxed ")
    if bare > start:
        rest = text[bare + len("\\boxed ") :]
        answer = rest.split("$", 1)[0].split(" ", 1)[0].strip()
        return answer or None
    if start < 0:
        return None
    return _closed(text, start + len(opener))
