"""Partial training (slime's --only-train-params-name-list / --freeze-params-name-list): parameters whose
Megatron name matches are frozen before the model is wrapped in DDP, so they get no gradient buffer and no
optimizer state, and the optimizer never moves them.

Patterns are Python regexes searched in Megatron parameter names (`decoder.layers.3.mlp.linear_fc1.weight`,
`embedding.word_embeddings.weight`, `output_layer.weight`), as in slime: with an only-train list every
parameter no pattern matches is frozen; with a freeze list every parameter a pattern matches is; both lists
apply together.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from slime.errors import ConfigError

logger = logging.getLogger(__name__)


def frozen_names(names: Iterable[str], only_train: list[str] | None, freeze: list[str] | None) -> set[str]:
    """The parameter names the two pattern lists freeze."""
    try:
        keep = [re.compile(p) for p in only_train or []]
        drop = [re.compile(p) for p in freeze or []]
    except re.error as e:
        raise ConfigError(f"only_train_params_name_list / freeze_params_name_list: bad regex {e.pattern!r}: {e}") \
            from None
    out = set()
    for name in names:
        if (keep and not any(p.search(name) for p in keep)) or any(p.search(name) for p in drop):
            out.add(name)
    return out


def freeze_callback(only_train: list[str] | None, freeze: list[str] | None) -> Callable[..., None] | None:
    """An mbridge post-model-creation callback that freezes the matching parameters (None: nothing to do)."""
    if not only_train and not freeze:
        return None

    def callback(model: torch.nn.Module, **_: Any) -> None:
        names = [name for name, _ in model.named_parameters()]
        frozen = frozen_names(names, only_train, freeze)
        if len(frozen) == len(names):
            raise ConfigError(f"only_train_params_name_list {only_train} / freeze_params_name_list {freeze} freeze "
                              f"every parameter ({len(names)}): nothing would train")
        for name, param in model.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
        logger.info("partial training: %d of %d parameter tensors frozen", len(frozen), len(names))

    return callback
