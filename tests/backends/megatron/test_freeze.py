"""Partial training: which Megatron parameter names slime's only-train / freeze regex lists freeze."""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron.freeze import freeze_callback, frozen_names
from slime.errors import ConfigError

NAMES = ["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
         "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc2.weight",
         "decoder.final_layernorm.weight", "output_layer.weight"]


def test_only_train_freezes_everything_else():
    assert frozen_names(NAMES, [r"mlp\."], None) == set(NAMES) - {NAMES[2], NAMES[3]}


def test_freeze_list_freezes_the_matches():
    assert frozen_names(NAMES, None, ["embedding", "output_layer"]) == {NAMES[0], NAMES[5]}


def test_both_lists_apply_together():
    assert frozen_names(NAMES, [r"layers\.0\."], [r"linear_qkv"]) == set(NAMES) - {NAMES[2]}


def test_bad_regex_and_freezing_everything_are_config_errors():
    with pytest.raises(ConfigError, match="bad regex"):
        frozen_names(NAMES, ["(unclosed"], None)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="freeze every parameter"):
        freeze_callback(None, ["."])(model)
    assert freeze_callback(None, None) is None


def test_callback_sets_requires_grad():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    freeze_callback(None, [r"^0\."])(model, pre_process=True, post_process=True)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == \
        {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True}
