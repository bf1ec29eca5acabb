"""Run megatron-core (and mbridge) on a machine without CUDA: the tiny-model path of tests and CI.

megatron-core 0.16 assumes CUDA in a handful of places: `torch.cuda.current_device()` and
`synchronize()`, the CUDA RNG tracker, hard-coded `device="cuda"` in factory calls and `.cuda()`, and
`Tensor.type()` checks for `torch.cuda.FloatTensor`. `activate()` redirects each of these to the CPU,
process-wide. It is called only when CUDA is unavailable and never on a GPU machine (it refuses to);
nothing else in the project imports it. See ../shared/research/megatron.md for how each patch was
found. Numerics are unchanged: the model runs the same torch ops on CPU tensors.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_active = False

# torch functions that take a `device=` argument and that megatron calls with device="cuda"
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "empty_like",
              "zeros_like", "ones_like", "full_like", "as_tensor", "eye", "linspace", "empty_strided")


def _cpu_device(device: Any) -> Any:
    """'cuda', 'cuda:0', torch.device('cuda') or a CUDA index -> 'cpu'; anything else unchanged."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


def _redirect_device_kwarg(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


def activate() -> None:
    """Install the CPU redirections (idempotent). Raises on a machine where CUDA works."""
    global _active
    if _active:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat.activate() on a CUDA machine: the CPU compatibility layer is for CPU only")

    # 1. device queries and synchronisation
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None

    # 2. the CUDA RNG API onto the CPU generator (manual_seed_all must stay a no-op: torch.manual_seed
    #    calls it, and routing it back to torch.manual_seed would recurse)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # 3. hard-coded device="cuda": factories, Tensor.to, Tensor.cuda, Module.cuda. torch keeps a cached
    #    list of factory functions for `with torch.device(...)`; build it before wrapping the
    #    factories, or that context (used by transformers' from_pretrained) stops placing tensors.
    torch.utils._device._device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _redirect_device_kwarg(getattr(torch, name)))

    original_to = torch.Tensor.to

    def tensor_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple(_cpu_device(a) if isinstance(a, str | torch.device) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = tensor_to
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    # 4. megatron's DistributedOptimizer and clip_grads check for CUDA float types by name
    original_type = torch.Tensor.type

    def tensor_type(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        if dtype is None:
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and "cuda" not in name else name
        return original_type(self, dtype, *args, **kwargs)

    torch.Tensor.type = tensor_type
    _active = True
    logger.info("megatron CPU compatibility layer active (no CUDA on this machine)")


def is_active() -> bool:
    return _active
