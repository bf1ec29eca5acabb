"""Find the last `\\boxed{...}` (or `\\fbox{...}`) answer in a response, honouring nested braces.

Several graders (the `boxed_` prefix, deepscaler, dapo's strict mode) look only at the final boxed
answer, as in slime's `rm_hub`: a model may box intermediate results, the last box is the answer.
"""

from __future__ import annotations

_OPENERS = ("\\boxed{", "\\fbox{")


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
    depth = 0
    for i in range(start + len(opener) - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(opener) : i]
    return None  # an unclosed box (truncated response): no answer
