"""slime's Megatron hooks are loaded and signature-checked when a train rank starts (the calls are checked
in tests/ray/test_rl_actors.py)."""

from __future__ import annotations

import pytest

from slime.backends.megatron.hooks import load_megatron_hooks
from slime.config import load_config
from slime.plugins import PluginError


def test_hooks_with_slimes_signatures_load(make_module):
    mod = make_module("def init(args):\n    pass\n"
                      "def log_prob(args, model, store_prefix):\n    pass\n"
                      "def step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):\n    pass\n")
    args = load_config(None, ["--custom-megatron-init-path", f"{mod}.init",
                              "--custom-megatron-before-log-prob-hook-path", f"{mod}.log_prob",
                              "--custom-megatron-before-train-step-hook-path", f"{mod}.step"]).as_namespace()
    hooks = load_megatron_hooks(args)
    assert (hooks.init.__name__, hooks.before_log_prob.__name__, hooks.before_train_step.__name__) == \
        ("init", "log_prob", "step")
    assert load_megatron_hooks(load_config(None, []).as_namespace()).init is None


@pytest.mark.parametrize(("flag", "source"), [
    ("--custom-megatron-init-path", "def fn():\n    pass\n"),
    ("--custom-megatron-before-log-prob-hook-path", "def fn(args, model):\n    pass\n"),
    ("--custom-megatron-before-train-step-hook-path", "def fn(args, rollout_id, step_id, model):\n    pass\n"),
    ("--custom-megatron-init-path", "async def fn(args):\n    pass\n"),
])
def test_wrong_signature_fails_naming_the_flag(make_module, flag, source):
    mod = make_module(source)
    with pytest.raises(PluginError, match=flag):
        load_megatron_hooks(load_config(None, [flag, f"{mod}.fn"]).as_namespace())
