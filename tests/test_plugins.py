"""Tests for slime.plugins: dotted-path loading with precise errors, and signature checks."""

from __future__ import annotations

import functools

import pytest

from slime.errors import ConfigError
from slime.plugins import PluginError, check_signature, load_function


def test_loads_function_and_caches(make_module):
    mod = make_module("def keep(args, rollout_id, buffer, num_groups):\n    return buffer[:num_groups]\n")
    fn = load_function(f"{mod}.keep")
    assert fn(None, 0, [[1], [2], [3]], 2) == [[1], [2]]
    assert load_function(f"{mod}.keep") is fn


def test_loads_builtin_by_path():
    assert load_function("os.path.join")("a", "b") in ("a/b", "a\\b")


def test_missing_module_names_path_and_import_error():
    with pytest.raises(PluginError) as info:
        load_function("no_such_pkg_xyz.filters.keep")
    message = str(info.value)
    assert "'no_such_pkg_xyz.filters.keep'" in message
    assert "ModuleNotFoundError" in message and "no_such_pkg_xyz" in message
    assert isinstance(info.value, ConfigError)


def test_module_that_raises_at_import(make_module):
    mod = make_module("raise RuntimeError('boom at import')\n")
    with pytest.raises(PluginError, match="cannot import module.*RuntimeError: boom at import"):
        load_function(f"{mod}.fn")


def test_missing_attribute_suggests_close_name(make_module):
    mod = make_module("def pop_first(a, b, c, d):\n    return []\n\ndef unrelated():\n    pass\n")
    with pytest.raises(PluginError, match=r"has no attribute 'pop_frist'; did you mean pop_first\?"):
        load_function(f"{mod}.pop_frist")


def test_missing_attribute_lists_names_when_nothing_close(make_module):
    mod = make_module("def alpha():\n    pass\n")
    with pytest.raises(PluginError, match="no attribute 'zzz'; it defines: alpha"):
        load_function(f"{mod}.zzz")


def test_not_callable(make_module):
    mod = make_module("THRESHOLD = 0.5\n")
    with pytest.raises(PluginError, match=r"THRESHOLD' is a float, not a function"):
        load_function(f"{mod}.THRESHOLD")


@pytest.mark.parametrize("path", ["nodots", "trailing.", ".leading"])
def test_path_without_module_part(path):
    with pytest.raises(PluginError, match="expected a dotted path"):
        load_function(path)


PARAMS = ["args", "rollout_id", "buffer", "num_groups"]


def good(args, rollout_id, buffer, num_groups):
    return []


def with_defaults(args, rollout_id, buffer, num_groups=1, extra=None, *rest, **kw):
    return []


class CallableFilter:
    def __call__(self, args, rollout_id, buffer, num_groups):
        return []


@pytest.mark.parametrize(
    "fn", [good, with_defaults, CallableFilter(), functools.partial(with_defaults, extra=2), lambda *a: a]
)
def test_signature_accepts_compatible(fn):
    check_signature(fn, "m.fn", PARAMS, is_async=False)


def test_signature_too_few_params():
    def three(args, rollout_id, buffer):
        return []

    with pytest.raises(PluginError) as info:
        check_signature(three, "my.filters.three", PARAMS)
    message = str(info.value)
    assert "'my.filters.three'" in message
    assert "(args, rollout_id, buffer)" in message  # its signature
    assert "fn(args, rollout_id, buffer, num_groups)" in message  # how it is called


def test_signature_required_keyword_only_param():
    def kwonly(args, rollout_id, buffer, num_groups, *, needed):
        return []

    with pytest.raises(PluginError, match="needed"):
        check_signature(kwonly, "m.kwonly", PARAMS)


def test_async_expected_but_sync_given():
    def rm(args, sample):
        return 1.0

    with pytest.raises(PluginError, match=r"'m.rm' must be an `async def` function; it is called as await fn"):
        check_signature(rm, "m.rm", ["args", "sample"], is_async=True)


def test_sync_expected_but_async_given():
    async def filt(args, rollout_id, buffer, num_groups):
        return []

    class AsyncCallable:
        async def __call__(self, args, rollout_id, buffer, num_groups):
            return []

    for fn in (filt, AsyncCallable()):
        with pytest.raises(PluginError, match="must be a plain `def` function, not `async def`"):
            check_signature(fn, "m.filt", PARAMS, is_async=False)


def test_async_accepted_and_unchecked_when_none():
    async def rm(args, sample):
        return 1.0

    check_signature(rm, "m.rm", ["args", "sample"], is_async=True)
    check_signature(rm, "m.rm", ["args", "sample"])
