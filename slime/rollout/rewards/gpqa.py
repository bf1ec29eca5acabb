"""`rm_type: gpqa`: multiple-choice grading by option letter (slime's `rm_hub.gpqa` rules).

The correct letter comes from `metadata["correct_letter"]`, else a one-letter label ("C"), else an
integer label (index into the options), else the option whose text equals the label. The chosen letter
is read from the text after any `</think>`: "answer is C" / "option: C" / "C is correct" / "final answer:
C", falling back to the last stand-alone valid capital letter. Valid letters: `metadata["valid_letters"]`,
else A.. for as many `metadata["choices"]`, else A-J. When no letter can be compared, the response scores
1 if it contains the correct option's text (or `metadata["correct_answer"]` / `["answer_text"]`, or the
label), normalised to lower-case alphanumerics.
"""

from __future__ import annotations

import re
import string
from typing import Any

_DEFAULT_LETTERS = list(string.ascii_uppercase[:10])
_LETTER_PATTERNS = [
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
    re.compile(r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
]


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def _normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def extract_letter(response: str, valid_letters: list[str]) -> str | None:
    """The option letter the response chose, or None."""
    text = _after_thinking(response or "")
    valid = {letter.upper() for letter in valid_letters}
    for pattern in _LETTER_PATTERNS:
        match = pattern.search(text)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in valid:
            return letter
    return None


def _options(metadata: dict[str, Any]) -> tuple[list[str] | None, list[str]]:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        choices = [str(c) for c in choices.values()]
    elif choices is not None:
        choices = [str(c) for c in choices]
    if metadata.get("valid_letters"):
        letters = [str(letter).upper() for letter in metadata["valid_letters"]]
    elif choices:
        letters = list(string.ascii_uppercase[: len(choices)])
    else:
        letters = _DEFAULT_LETTERS
    return choices, letters


def gpqa_reward(response: str | None, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """1.0 when the response picks the correct option, else 0.0."""
    if response is None:
        return 0.0
    metadata = metadata or {}
    choices, letters = _options(metadata)
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = label.strip() if isinstance(label, str) else None
    if label_text and len(label_text) == 1 and label_text.upper() in letters and not correct:
        correct = label_text.upper()
    elif isinstance(label, int | float) and not isinstance(label, bool) and 0 <= int(label) < len(letters):
        correct = letters[int(label)]
    correct_text = None
    if not correct and choices and label_text:
        for i, choice in enumerate(choices):
            if _normalize(choice) == _normalize(label_text):
                correct, correct_text = letters[i], choice
                break

    chosen = extract_letter(response, letters)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0

    targets = []
    if correct and choices and correct in letters and letters.index(correct) < len(choices):
        targets.append(choices[letters.index(correct)])
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    targets += [t for t in (correct_text, label_text) if t]
    answer = _normalize(_after_thinking(response))
    if any(_normalize(t) and _normalize(t) in answer for t in targets):
        return 1.0
    if chosen and not correct and label_text:
        return 1.0 if chosen == label_text.upper() else 0.0
    return 0.0
