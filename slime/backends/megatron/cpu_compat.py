"""Run megatron-core (and mbridge) on a machine without CUDA: the tiny-model path of tests and CI.

megatron-core 0.16 assumes CUDA in a handful of places: `torch.cuda.current_device()` and
`synchronize()`, the CUDA RNG tracker, hard-coded `device="cuda"` in factory calls and `.cuda()`,
`Tensor.type()` checks for `torch.cuda.FloatTensor`, and the MoE token dispatcher's side stream (its
device-to-host copies of the split sizes). `activate()` redirects each of these to the CPU,
process-wide. It is called only when CUDA is unavailable and never on a GPU machine (it refuses to);
nothing else in the project imports it. See ../shared/research/megatron.md for how each patch was
found. Numerics are unchanged: the model runs the same torch ops on CPU tensors.
"""

from __future__ import annotations

import contextlib
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


class _HostStream:
    """A CUDA stream stand-in: on the CPU every op runs in order on the calling thread, so waiting for
    another stream or an event has nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


class _HostEvent:
    """A CUDA event stand-in (see `_HostStream`): always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _as_host_splits(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's `moe_utils.maybe_move_tensor_to_cpu` as it behaves on a GPU: the split sizes it is given
    come back as host values (numpy when asked), which `all_to_all_single` takes as its split lists; the
    original returns CPU tensors unchanged, so the splits would stay tensors."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


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

    # 5. the MoE alltoall dispatcher copies its split sizes to the host on a side stream (and the shared
    #    experts may overlap on one): streams and events that are always complete, and splits as numpy
    torch.cuda.Stream = lambda *a, **k: _HostStream()
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.Event = _HostEvent
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _as_host_splits
    token_dispatcher.maybe_move_tensor_to_cpu = _as_host_splits
    _active = True
    logger.info("megatron CPU compatibility layer active (no CUDA on this machine)")


def is_active() -> bool:
    return _active
