"""What the modules of the config package share: the base class of a section, the signature of a check, and
the "did you mean" hint of an unknown name."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, NoReturn

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# The whole tree (slime.config.tree.Config) as the checks beside each section see it: tree.py builds Config from
# the sections' classes, so their modules cannot import it.
ConfigTree = Any
# fail(field, message, *related fields) raises a ConfigError naming where each field was set (validate.py)
Fail = Callable[..., NoReturn]


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
