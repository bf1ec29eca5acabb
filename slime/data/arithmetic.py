"""The kits' synthetic task: integer arithmetic problems with exact answers (`slime.data.tiny` draws its splits
from them, `slime.data.pretrain` its pretraining conversations)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


def draw_problem(rng: random.Random, digits: int, ops: Sequence[str], allow_negative: bool = False) -> dict[str, Any]:
    """One problem as a data row (prompt "a<op>b=", label, metadata). Both operands have exactly `digits` digits
    (the 1-digit tier includes 0), so a tier is a difficulty; without `allow_negative` a subtraction's larger
    operand comes first."""
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(list(ops))
    if op == "-" and not allow_negative and a < b:
        a, b = b, a
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    meta = {"a": a, "b": b, "op": op, "digits": digits}
    return {"prompt": f"{a}{op}{b}=", "label": str(answer), "metadata": meta}
