"""`rm_type: f1`: SQuAD-style token F1 between the response and the label (slime's `rm_hub.f1`).

Both sides are lower-cased, stripped of punctuation and the articles a/an/the, and split on
whitespace. A yes/no/noanswer on either side must match exactly (partial credit for "yes" against
"no" would be meaningless).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_EXACT_ONLY = {"yes", "no", "noanswer"}


def normalize_text(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_reward(response: str | None, label: Any) -> float:
    """Token F1 in [0, 1]; 0 when either side is empty or nothing overlaps."""
    if response is None or label is None:
        return 0.0
    pred, gold = normalize_text(response), normalize_text(str(label))
    if (pred in _EXACT_ONLY or gold in _EXACT_ONLY) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)
