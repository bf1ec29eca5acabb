"""slime's rollout hook signatures, checked when loaded; sample hooks applied in order (no engines here;
tests/ray/test_rollout_manager_hooks.py runs them in a rollout)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from slime.plugins import PluginError
from slime.rollout.hooks import apply_sample_hooks, load_eval_function, load_log_functions, load_sample_hooks
from slime.types import Sample


def _args(**fields):
    base = {"rollout_function_path": "slime.rollout.generate_rollout", "eval_function_path": None,
            "custom_rollout_log_function_path": None, "custom_eval_rollout_log_function_path": None,
            "rollout_sample_hook_path": []}
    return argparse.Namespace(**{**base, **fields})


def test_sample_hooks_get_only_the_keywords_they_name_and_may_replace_the_sample(make_module):
    mod = make_module(
        "from slime.types import Sample\n"
        "def plain(args, sample):\n    sample.metadata['plain'] = True\n"
        "def named(args, sample, *, evaluation=False):\n    sample.metadata['evaluation'] = evaluation\n"
        "async def swap(args, sample, rollout_id=None):\n"
        "    return Sample(index=sample.index, metadata={**sample.metadata, 'rollout_id': rollout_id})\n")
    hooks = load_sample_hooks(_args(rollout_sample_hook_path=[f"{mod}.plain", f"{mod}.named", f"{mod}.swap"]))
    original = Sample(index=7, metadata={})
    out = asyncio.run(apply_sample_hooks(hooks, None, original, rollout_id=4, evaluation=True))
    assert out is not original and out.index == 7
    assert out.metadata == {"plain": True, "evaluation": True, "rollout_id": 4}


def test_sample_hook_returning_something_else_is_an_error(make_module):
    mod = make_module("def bad(args, sample):\n    return 1.0\n")
    hooks = load_sample_hooks(_args(rollout_sample_hook_path=[f"{mod}.bad"]))
    with pytest.raises(TypeError, match=r"hook '.*\.bad' returned float, expected Sample or None"):
        asyncio.run(apply_sample_hooks(hooks, None, Sample(index=0), rollout_id=0, evaluation=False))


@pytest.mark.parametrize(("field", "source", "loader"), [
    ("rollout_sample_hook_path", "def fn(sample):\n    pass\n", load_sample_hooks),
    ("custom_rollout_log_function_path", "def fn(rollout_id, args, samples):\n    return False\n",
     load_log_functions),
    ("custom_eval_rollout_log_function_path", "def fn(rollout_id, args, data):\n    return False\n",
     load_log_functions),
    ("custom_rollout_log_function_path", "async def fn(rollout_id, args, samples, m, t):\n    return False\n",
     load_log_functions),
    ("eval_function_path", "def fn(args, rollout_id):\n    pass\n", load_eval_function),
])
def test_wrong_signature_fails_at_load_naming_the_flag(make_module, field, source, loader):
    mod = make_module(source)
    value = [f"{mod}.fn"] if field == "rollout_sample_hook_path" else f"{mod}.fn"
    with pytest.raises(PluginError, match=f"--{field.replace('_', '-')}"):
        loader(_args(**{field: value}))


def test_eval_function_defaults_to_the_rollout_function():
    from slime.rollout import generate_rollout

    assert load_eval_function(_args()) is generate_rollout
    assert load_log_functions(_args()) == (None, None)

