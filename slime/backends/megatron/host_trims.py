"""Host work megatron-core does per linear layer call that changes nothing: skipped.

On an H100 the 0.5B train step is bound by the host issuing kernels (bench/host_cost.py, docs/megatron.md "Host
cost of a train step"), so per-call Python in megatron's linear layers is paid ~1000 times a step. Three pieces of it
do no work here:

* `LinearWithGradAccumulationAndAsyncCommunication.backward` (every trainable linear layer's backward) and
  `LinearWithFrozenWeight.backward` (every frozen one's: LoRA's base layers) are wrapped by torch's `custom_bwd`,
  which enters `torch.autocast(enabled=<forward's autocast state>)` around them: a context object, four state calls
  and an autocast-cache clear per call. When the forward ran without autocast and none is active now (slime's
  training never enables it: megatron's `Float16Module` holds bf16 parameters), that context sets autocast to the
  off state it is already in. `lean_backward` (`lean_frozen_backward`) calls the undecorated backward then, and
  the decorated one otherwise (same autocast state either way, so the same kernels and bits).
* `RowParallelLinear.forward` passes `tp_group=None` to `linear_with_grad_accumulation_and_async_allreduce`, whose
  `get_tensor_model_parallel_group_if_none` then issues a `DeprecationWarning` (filtered by Python's warnings
  machinery at every call: ~5 us) before returning the default tensor-parallel group. `tp_group_if_none` returns
  that same group without the warning; expert groups and uninitialised states go to megatron's function.
* Without tensor parallelism, `ColumnParallelLinear` passes its input through `copy_to_tensor_model_parallel_region`
  and `RowParallelLinear` (and the vocab-parallel embedding) their output through
  `reduce_from_tensor_model_parallel_region`: custom autograd Functions that are the identity both ways when the
  group has one rank (megatron's `_reduce` returns its input then), yet cost a Python `Function.apply` forward and a
  Python backward node each, 4 a layer per micro-batch. `copy_to_region` / `reduce_from_region` return the tensor
  itself for a one-rank group (the same values forward and backward) and call megatron's functions otherwise.

`install(True)` puts them in place (idempotent; `make_bridge` does it); `install(False)` restores megatron's
originals, the A/B of `bench/train_step.py --no-host-trims` and `bench/host_cost.py --no-host-trims`.
"""

from __future__ import annotations

from typing import Any

import torch

_ORIGINAL: dict[str, Any] = {}  # megatron's own functions, kept by the first `install`


def _lean(key: str) -> Any:
    """A backward for the Function whose `custom_bwd`-decorated backward is `_ORIGINAL[key]`: the undecorated one
    where the autocast context would change nothing, else the decorated one."""
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        decorated = _ORIGINAL[key]
        if ctx._fwd_used_autocast or torch.is_autocast_enabled("cuda"):
            return decorated(ctx, grad_output)
        return decorated.__wrapped__(ctx, grad_output)
    backward.__name__ = backward.__qualname__ = f"lean_{key}"
    return backward


lean_backward = _lean("backward")  # LinearWithGradAccumulationAndAsyncCommunication: trainable weights
lean_frozen_backward = _lean("frozen_backward")  # LinearWithFrozenWeight: frozen ones (LoRA's base, a freeze list)


def tp_group_if_none(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
    """megatron's `get_tensor_model_parallel_group_if_none` minus the deprecation warning for `None`."""
    if tp_group is None and not is_expert:
        from megatron.core import parallel_state

        if torch.distributed.is_initialized() and parallel_state.is_initialized():
            return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
    return _ORIGINAL["tp_group"](tp_group, is_expert=is_expert, check_initialized=check_initialized)


def copy_to_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """megatron's `copy_to_tensor_model_parallel_region`, the tensor itself for a one-rank group."""
    group = tp_group_if_none(group)
    if group is not None and group.size() == 1:
        return input_
    return _ORIGINAL["copy_to"](input_, group=group)


def reduce_from_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """megatron's `reduce_from_tensor_model_parallel_region`, the tensor itself for a one-rank group."""
    group = tp_group_if_none(group)
    if group is not None and group.size() == 1:
        return input_
    return _ORIGINAL["reduce_from"](input_, group=group)


_PATCHED = {"tp_group": ("get_tensor_model_parallel_group_if_none", tp_group_if_none),
            "copy_to": ("copy_to_tensor_model_parallel_region", copy_to_region),
            "reduce_from": ("reduce_from_tensor_model_parallel_region", reduce_from_region)}


def install(enabled: bool = True) -> None:
    """Put the trims where megatron's linear layers look them up (`enabled`), or megatron's originals back."""
    from megatron.core.tensor_parallel import layers

    functions = {"backward": (layers.LinearWithGradAccumulationAndAsyncCommunication, lean_backward),
                 "frozen_backward": (layers.LinearWithFrozenWeight, lean_frozen_backward)}
    if not _ORIGINAL:
        backwards = {key: function.__dict__["backward"].__func__ for key, (function, _) in functions.items()}
        if not all(hasattr(b, "__wrapped__") for b in backwards.values()):  # torch's custom_bwd does not wrap them
            return
        _ORIGINAL.update(backwards, **{key: getattr(layers, name) for key, (name, _) in _PATCHED.items()})
    for key, (function, lean) in functions.items():
        function.backward = staticmethod(lean if enabled else _ORIGINAL[key])
    for key, (name, trimmed) in _PATCHED.items():
        setattr(layers, name, trimmed if enabled else _ORIGINAL[key])


def installed() -> bool:
    """Whether the trims are in place."""
    from megatron.core.tensor_parallel import layers

    return (layers.LinearWithGradAccumulationAndAsyncCommunication.__dict__["backward"].__func__ is lean_backward
            and layers.LinearWithFrozenWeight.__dict__["backward"].__func__ is lean_frozen_backward)
