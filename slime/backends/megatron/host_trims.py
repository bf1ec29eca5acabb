"""Host work megatron-core does per linear layer call that changes nothing: skipped.

On an H100 the 0.5B train step is bound by the host issuing kernels (bench/host_cost.py, docs/megatron.md "Host
cost of a train step"), so per-call Python in megatron's linear layers is paid ~1000 times a step. Three pieces of it
do no work here:

* `LinearWithGradAccumulationAndAsyncCommunication.backward` (every trainable linear layer's backward) is wrapped
  by torch's `custom_bwd`, which enters `torch.autocast(enabled=<forward's autocast state>)` around it: a context
  object, four state calls and an autocast-cache clear per call. When the forward ran without autocast and none is
  active now (slime's training never enables it: megatron's `Float16Module` holds bf16 parameters), that context
  sets autocast to the off state it is already in. `lean_backward` calls the undecorated backward then, and the
  decorated one otherwise (same autocast state either way, so the same kernels and bits).
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

`install(True)` puts both in place (idempotent; `make_bridge` does it); `install(False)` restores megatron's
originals, the A/B of `bench/train_step.py --no-host-trims` and `bench/host_cost.py --no-host-trims`.
"""

from __future__ import annotations

from typing import Any

import torch

_ORIGINAL: dict[str, Any] = {}  # megatron's own functions, kept by the first `install`


def lean_backward(ctx: Any, grad_output: torch.Tensor) -> Any:
    """megatron's linear backward, without torch's autocast context when that context would change nothing."""
    if ctx._fwd_used_autocast or torch.is_autocast_enabled("cuda"):
        return _ORIGINAL["backward"](ctx, grad_output)
    return _ORIGINAL["backward"].__wrapped__(ctx, grad_output)


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

    function = layers.LinearWithGradAccumulationAndAsyncCommunication
    if not _ORIGINAL:
        backward = function.__dict__["backward"]
        backward = backward.__func__ if isinstance(backward, staticmethod) else backward
        if not hasattr(backward, "__wrapped__"):  # a megatron whose backward torch's custom_bwd does not wrap
            return
        _ORIGINAL.update(backward=backward, **{key: getattr(layers, name) for key, (name, _) in _PATCHED.items()})
    function.backward = staticmethod(lean_backward if enabled else _ORIGINAL["backward"])
    for key, (name, trimmed) in _PATCHED.items():
        setattr(layers, name, trimmed if enabled else _ORIGINAL[key])


def installed() -> bool:
    """Whether the trims are in place."""
    from megatron.core.tensor_parallel import layers

    return layers.LinearWithGradAccumulationAndAsyncCommunication.__dict__["backward"].__func__ is lean_backward
