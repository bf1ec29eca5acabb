"""User plugins: functions named in the config by a dotted path (`my_pkg.filters.keep_hard`).

As in slime's `load_function`, every `*_path` field holds `module.attribute`; built-in defaults are
named the same way. Two additions: a failed load says which part failed (module import, missing
attribute with close names, not callable), and `check_signature` lets the config layer reject a
function that cannot take the hook's arguments before any GPU is claimed.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from slime.errors import ConfigError


class PluginError(ConfigError):
    """A plugin path does not resolve to a usable function; the message names the path."""


@functools.cache
def load_function(path: str) -> Callable[..., Any]:
    """Import `path` (`package.module.function`) and return the callable it names (cached per path)."""
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"plugin path {path!r}: expected a dotted path 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or any error raised while the user's module runs
        raise PluginError(f"plugin {path!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        public = [name for name in dir(module) if not name.startswith("_")]
        close = difflib.get_close_matches(attr, public, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"it defines: {', '.join(public[:20]) or 'nothing'}"
        raise PluginError(f"plugin {path!r}: module {module_name!r} has no attribute {attr!r}; {hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise PluginError(f"plugin {path!r} is a {type(fn).__name__}, not a function")
    return fn


def load_plugin_field(args: Any, field: str, params: list[str], *, is_async: bool | None) -> Callable[..., Any] | None:
    """The function `args.<field>` names, loaded and checked to take `params` (None when the field is
    unset); errors name the field and its flag."""
    path = getattr(args, field, None)
    if not path:
        return None
    try:
        fn = load_function(path)
        check_signature(fn, path, params, is_async=is_async)
    except PluginError as e:
        raise PluginError(f"{field} (--{field.replace('_', '-')}): {e}") from e
    return fn


def _is_async(fn: Callable[..., Any]) -> bool:
    # A callable object counts as async when its __call__ is `async def`.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def check_signature(
    fn: Callable[..., Any], path: str, expected_params: list[str], *, is_async: bool | None = None
) -> None:
    """Raise `PluginError` unless `fn(*expected_params)` is a valid call (and, when `is_async` is
    given, `fn` is / is not an `async def`). Functions without an inspectable signature pass."""
    call = f"fn({', '.join(expected_params)})"
    if is_async is not None and _is_async(fn) != is_async:
        want = "an `async def` function" if is_async else "a plain `def` function, not `async def`"
        raise PluginError(f"plugin {path!r} must be {want}; it is called as {'await ' if is_async else ''}{call}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C extensions expose no signature
        return
    try:
        signature.bind(*expected_params)  # the names stand in for the values: only arity matters
    except TypeError as e:
        raise PluginError(f"plugin {path!r} has signature {signature} but is called as {call}: {e}") from None
