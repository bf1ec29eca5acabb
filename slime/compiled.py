"""torch.compile'd functions that say which option turns them off when they cannot be built.

The project compiles a few hot functions on CUDA by default (the scoring chunks, `train.compile_scores`; the
engine's sampler, `--disable-sampler-compile`). Compilation happens at the first call, deep inside a train step
or a decode step; where inductor or Triton cannot build the kernels there (no C++ compiler, a Triton error), the
error should name the option that runs the eager code instead, not only the compiler's traceback.
`triton_on_cuda()` is the one check of where GPU kernels can be built with Triton: by inductor, and by the
backend's hand-written kernels (rope_kernel, swiglu_kernel).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from slime.errors import ConfigError


@functools.cache
def triton_on_cuda() -> bool:
    """A CUDA device present and Triton importable: inductor makes GPU kernels, Triton kernels run."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def compiled(fn: Callable[..., Any], off: str, **options: Any) -> Callable[..., Any]:
    """`torch.compile(fn, **options)`, whose compilation failure raises ConfigError saying `off` (how to run
    the eager code instead)."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    built = torch.compile(fn, **options)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return built(*args, **kwargs)
        except (BackendCompilerFailed, InductorError) as exc:
            first = (str(exc).splitlines() or [""])[0][:300]
            raise ConfigError(f"torch.compile could not build {fn.__qualname__} here ({type(exc).__name__}: "
                              f"{first}); {off}") from exc

    return call
