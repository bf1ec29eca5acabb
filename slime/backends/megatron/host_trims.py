"""Host work megatron-core does per linear layer call that changes nothing: skipped.

On an H100 the 0.5B train step is bound by the host issuing kernels (bench/host_cost.py, docs/megatron.md "Host
cost of a train step"), so per-call Python in megatron's linear layers is paid ~1000 times a step. Two pieces of it
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


def install(enabled: bool = True) -> None:
    """Put the trims where megatron's linear layers look them up (`enabled`), or megatron's originals back."""
    from megatron.core.tensor_parallel import layers

    function = layers.LinearWithGradAccumulationAndAsyncCommunication
    if not _ORIGINAL:
        backward = function.__dict__["backward"]
        backward = backward.__func__ if isinstance(backward, staticmethod) else backward
        if not hasattr(backward, "__wrapped__"):  # a megatron whose backward torch's custom_bwd does not wrap
            return
        _ORIGINAL.update(backward=backward, tp_group=layers.get_tensor_model_parallel_group_if_none)
    function.backward = staticmethod(lean_backward if enabled else _ORIGINAL["backward"])
    layers.get_tensor_model_parallel_group_if_none = tp_group_if_none if enabled else _ORIGINAL["tp_group"]


def installed() -> bool:
    """Whether the trims are in place."""
    from megatron.core.tensor_parallel import layers

    return layers.LinearWithGradAccumulationAndAsyncCommunication.__dict__["backward"].__func__ is lean_backward
