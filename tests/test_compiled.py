"""slime.compiled: a torch.compile'd function runs as compiled, and a failure to build it names the option that
turns it off."""

import pytest
import torch
from torch._inductor.exc import InductorError

from slime.compiled import compiled
from slime.errors import ConfigError


def double_plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_runs_the_function_compiled():
    fn = compiled(double_plus_one, "set it off", backend="eager", dynamic=True)
    assert fn.__name__ == "double_plus_one"
    assert torch.equal(fn(torch.arange(4.0)), torch.tensor([1.0, 3.0, 5.0, 7.0]))


def test_a_build_failure_names_the_option(monkeypatch):
    def broken(*args, **kwargs):
        raise InductorError(RuntimeError("no C++ compiler"), "compile failed")

    monkeypatch.setattr(torch, "compile", lambda fn, **options: broken)
    fn = compiled(double_plus_one, "start with --no-compile")
    with pytest.raises(ConfigError, match=r"could not build double_plus_one here .*start with --no-compile"):
        fn(torch.ones(2))


def test_other_errors_pass_through(monkeypatch):
    """A bug in the function itself is not a build failure: its own exception, unchanged."""
    fn = compiled(lambda x: x.reshape(3), "unused", backend="eager")
    with pytest.raises(RuntimeError, match="shape"):
        fn(torch.ones(2))
