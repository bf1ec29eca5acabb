"""The Megatron optimizer and its LR schedule for DDP-wrapped model chunks, and what checkpoints need of them.

One function, `build_optimizer_and_scheduler`, turns the `train:` config into megatron-core's optimizer
plus its `OptimizerParamScheduler`, so SFT, RL and checkpoint resume construct the identical pair.
The scheduler counts optimizer steps (call `scheduler.step(1)` after each `train_step`); Megatron's own
loop counts samples, which is the same schedule at a fixed global batch size.

megatron-core 0.16.1's DistributedOptimizer cannot round-trip a torch_dist checkpoint without Apex or
Transformer Engine (neither is installed here, on CPU or GPU). Fixes 1-3 measured in
../shared/research/megatron.md; all four live here:

1. a fresh torch Adam has no state, and `DistributedOptimizer.state_dict()` asserts on its `step`:
   `init_optimizer_state` fills empty Adam state (zeros, step 0: what Adam's first step would create)
   before any sharded state dict is built;
2. `_set_main_param_and_optimizer_states` copies into leaf parameters outside `no_grad`, expects a
   `step` in the saved tensors, and where one is there ('dp_reshardable') it is the template's value, which
   would overwrite the step just restored from the param groups: replaced on each DistributedOptimizer
   instance (`build_optimizer`) by a setter that never touches `step`;
3. after loading, megatron gives every parameter one shared `step` tensor, which torch Adam then
   increments once per parameter (wrong bias correction): `untie_adam_steps` gives each its own copy;
4. megatron saves that shared step (`common_step`) only when it is non-zero (`if step:`), so an optimizer
   saved before its first step (a PPO actor during --num-critic-only-steps) loads with moments and no
   `step`, which torch Adam's `load_state_dict` refuses (KeyError): `restore_zero_steps` puts step 0 back.

Without Apex or Transformer Engine, megatron's gradient clipping falls back to a per-tensor loop: one norm
and one `.item()` (a GPU->host synchronisation) per gradient, and a multiply and a copy per gradient when
it clips. `use_foreach_clipping` (called by `build_optimizer`) puts torch's multi-tensor (foreach) ops in
their place: the same norm and scaling, a few kernels and no synchronisation per parameter (issue 18: the
LoRA step, 224 adapter tensors at 1.5B, is launch-bound).

Under bf16 megatron copies the fp32 main parameters back into the bf16 model parameters after each step with one
`copy_` per parameter (its multi-tensor copy has no bf16 kernel, `_multi_tensor_copy_this_to_that`): ~170 launches a
step at 0.5B (bench/op_census.py). `use_foreach_param_copy` (called by `build_optimizer`) makes that one
`torch._foreach_copy_`: the same conversion (round to nearest even) in a few multi-tensor launches.

Without Apex or Transformer Engine megatron also builds torch's AdamW with its defaults: the foreach
(multi-tensor) kernels on CUDA. `use_fused_adam` (train.fused_adam, on by default where CUDA has no
Apex/TE) switches its param groups to torch's fused AdamW kernel, one kernel per device and dtype for the
whole update. The fused kernel wants each `step` as a float32 tensor on its parameter's device, where
torch's other kernels keep it on the CPU: `init_optimizer_state` creates it there, and a post-hook on the
torch optimizer's `load_state_dict` puts back the chosen kernel and the steps' device after a load (torch
takes every param group option, `fused` included, from the saved state; a checkpoint written with one
kernel resumes with the other). Checkpoints hold the step's value only, so they do not depend on it.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from slime.config import Config, TrainConfig
from slime.errors import ConfigError

logger = logging.getLogger(__name__)


def build_optimizer(models: list[torch.nn.Module], *, lr: float, clip_grad: float, weight_decay: float = 0.0,
                    adam_beta1: float = 0.9, adam_beta2: float = 0.98, adam_eps: float = 1e-8,
                    bf16: bool = False, optimizer: str = "adam", use_distributed_optimizer: bool = False,
                    min_lr: float = 0.0, fused_adam: bool | None = None) -> Any:
    """Megatron's optimizer for DDP-wrapped model chunks (AdamW, or plain SGD without momentum; fp32 master
    weights under bf16). `use_distributed_optimizer` must match the DDP buffers (`build_model`); `lr` and
    `min_lr` also become each param group's `max_lr`/`min_lr`, which the scheduler reads. `fused_adam`:
    torch's fused AdamW kernel (None: where `fused_adam_default` says so), see `use_fused_adam`."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    if use_distributed_optimizer and optimizer != "adam":
        raise ConfigError(f"train.use_distributed_optimizer needs train.optimizer adam (got {optimizer!r}): "
                          "megatron's DistributedOptimizer checkpoints Adam state only")
    config = OptimizerConfig(optimizer=optimizer, lr=lr, min_lr=min_lr, weight_decay=weight_decay, adam_beta1=adam_beta1,
                             adam_beta2=adam_beta2, adam_eps=adam_eps, sgd_momentum=0.0, clip_grad=clip_grad,
                             bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                             use_distributed_optimizer=use_distributed_optimizer)
    use_foreach_clipping()
    use_foreach_param_copy()
    megatron_optimizer = get_megatron_optimizer(config, models)
    for inner in _leaves(megatron_optimizer):
        if _is_distributed(inner):
            inner._set_main_param_and_optimizer_states = types.MethodType(_set_main_param_and_states, inner)  # fix 2
    if optimizer == "adam":
        use_fused_adam(megatron_optimizer, fused_adam_default() if fused_adam is None else fused_adam)
    model_config = get_model_config(models[0])
    model_config.finalize_model_grads_func = finalize_model_grads  # DDP gradient sync before the step
    model_config.grad_scale_func = megatron_optimizer.scale_loss
    return megatron_optimizer


def fused_adam_default() -> bool:
    """torch's fused AdamW where megatron falls back to torch's optimizer (no Apex/TE FusedAdam) on CUDA."""
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

    return torch.cuda.is_available() and USING_PYTORCH_OPTIMIZER


def use_fused_adam(optimizer: Any, fused: bool) -> None:
    """Run every torch Adam/AdamW inside megatron's `optimizer` with torch's fused kernel (`fused`) or with
    torch's default choice (foreach on CUDA, as megatron builds it), and keep it so across checkpoint loads.
    Same update either way; the kernels differ in rounding only."""
    adams = [o for o in torch_optimizers(optimizer) if isinstance(o, torch.optim.Adam)]
    if fused and not adams and torch_optimizers(optimizer):
        raise ConfigError("train.fused_adam: megatron's optimizer here is not torch's Adam (Apex or Transformer "
                          "Engine provides FusedAdam); leave fused_adam unset")
    for adam in adams:
        if fused:
            for group in adam.param_groups:
                for param in group["params"]:
                    if param.device.type not in _fused_devices() or not torch.is_floating_point(param):
                        raise ConfigError(f"train.fused_adam: torch's fused AdamW has no kernel for {param.dtype} "
                                          f"parameters on {param.device.type} (it has {_fused_devices()})")
        adam._slime_fused = fused  # what the load hook restores
        if not getattr(adam, "_slime_fused_hook", False):
            adam.register_load_state_dict_post_hook(_restore_kernel)
            adam._slime_fused_hook = True
        _restore_kernel(adam)


def _restore_kernel(adam: torch.optim.Optimizer) -> None:
    """The chosen kernel's group options, and each `step` where that kernel wants it (own tensor each)."""
    fused = adam._slime_fused
    for group in adam.param_groups:
        group["fused"], group["foreach"] = (True, False) if fused else (None, None)
        for param in group["params"]:
            state = adam.state.get(param)
            if state and isinstance(state.get("step"), torch.Tensor):
                state["step"] = _step_tensor(state["step"], group, param)


def _step_tensor(value: torch.Tensor | float, group: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    """A new float32 `step` tensor: on the parameter's device for the fused (or capturable) kernel, else on the
    CPU, as torch's Adam creates it."""
    device = param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32, copy=True)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def _fused_devices() -> list[str]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def use_foreach_clipping() -> bool:
    """Give megatron's clip_grads torch foreach versions of its local (no Apex/TE) multi-tensor fallbacks;
    whether they were installed (not where Apex or Transformer Engine provide the fused ones)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_applier

    if clip_grads.multi_tensor_applier is not local_multi_tensor_applier:
        return False
    clip_grads.l2_norm_impl = _foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = _foreach_scale
    return True


def use_foreach_param_copy(enabled: bool = True) -> None:
    """Megatron's main -> model parameter copy (and back, at load) as `torch._foreach_copy_` (`enabled`), or its own
    per-tensor loop; process-wide, like megatron's module function it replaces. Same values either way."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    global _loop_copy
    if _loop_copy is None:
        _loop_copy = mcore_optimizer._multi_tensor_copy_this_to_that
    mcore_optimizer._multi_tensor_copy_this_to_that = _foreach_copy_this_to_that if enabled else _loop_copy


_loop_copy: Any = None  # megatron's own _multi_tensor_copy_this_to_that, kept for use_foreach_param_copy(False)


def _foreach_copy_this_to_that(this: list[torch.Tensor], that: list[torch.Tensor], overflow_buf: Any = None) -> None:
    """megatron's `_multi_tensor_copy_this_to_that` contract (that[i] = this[i], converting the dtype); with an
    overflow buffer (its fp16 multi-tensor path) megatron's own."""
    if overflow_buf is not None:
        _loop_copy(this, that, overflow_buf)
    elif this:
        torch._foreach_copy_(that, this)


def _foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
                     *args: Any) -> tuple[torch.Tensor, None]:
    """megatron's `l2_norm_impl` contract: (the L2 norm of all of `tensor_lists[0]` as a [1] fp32 tensor, None),
    on the tensors' device: no `.item()` per tensor as in `megatron.core.utils.local_multi_tensor_l2_norm`."""
    norm = torch.nn.utils.get_total_norm(tensor_lists[0], 2.0)  # foreach where the device has it
    return norm.float().reshape(1), None


def _foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """megatron's `multi_tensor_scale_impl` contract: dst = src * scale (clipping scales the gradients in place)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def build_scheduler(optimizer: Any, train: TrainConfig, total_steps: int | None = None) -> Any:
    """megatron-core's `OptimizerParamScheduler` for `train:`'s schedule, counted in optimizer steps.

    `lr_decay_iters` defaults to `total_steps` (the stage's number of optimizer steps). Megatron sets the
    warmup's first learning rate (`lr_warmup_init`) at construction, so the first step runs at it.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = train.lr_decay_iters or total_steps
    if decay is None:
        if train.lr_decay_style not in ("constant", "inverse-square-root"):
            raise ConfigError(f"train.lr_decay_style {train.lr_decay_style!r} needs lr_decay_iters "
                              "(--lr-decay-iters) when the number of training steps is not known")
        decay = train.lr_warmup_iters + 1
    warmup = train.lr_warmup_iters
    if warmup >= decay and train.lr_decay_iters is None and total_steps is not None:
        # a stage shorter than the configured warmup (a shortened run of a full config): it warms up throughout
        warmup = decay - 1
        logger.warning("train.lr_warmup_iters %d is not below this stage's %d optimizer steps: warming up over "
                       "%d steps", train.lr_warmup_iters, decay, warmup)
    if warmup >= decay:
        raise ConfigError(f"train.lr_warmup_iters {warmup} must be below the decay length {decay} "
                          "(lr_decay_iters, or the stage's total optimizer steps)")
    if train.lr_decay_style == "WSD" and (train.lr_wsd_decay_iters or 0) > decay:
        raise ConfigError(f"train.lr_wsd_decay_iters {train.lr_wsd_decay_iters} exceeds the decay length {decay}")
    return OptimizerParamScheduler(
        optimizer, init_lr=train.lr_warmup_init, max_lr=train.lr, min_lr=train.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=train.lr_decay_style,
        start_wd=train.weight_decay, end_wd=train.weight_decay, wd_incr_steps=decay, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
        wsd_decay_steps=train.lr_wsd_decay_iters, lr_wsd_decay_style=train.lr_wsd_decay_style)


def build_optimizer_and_scheduler(models: list[torch.nn.Module], config: Config,
                                  total_steps: int | None = None) -> tuple[Any, Any]:
    """The optimizer and LR schedule that `config.train` describes, for DDP-wrapped `models`
    (built with `use_distributed_optimizer=config.train.use_distributed_optimizer`)."""
    optimizer = build_config_optimizer(models, config, config.train.use_distributed_optimizer)
    return optimizer, build_scheduler(optimizer, config.train, total_steps)


def build_config_optimizer(models: list[torch.nn.Module], config: Config, use_distributed_optimizer: bool) -> Any:
    """The optimizer `config.train` describes, without a schedule (export rebuilds one to hold a checkpoint's state)."""
    t = config.train
    return build_optimizer(models, lr=t.lr, clip_grad=t.clip_grad, weight_decay=t.weight_decay,
                           adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
                           bf16=bool(config.megatron.get("bf16")), optimizer=t.optimizer,
                           use_distributed_optimizer=use_distributed_optimizer, min_lr=t.min_lr,
                           fused_adam=t.fused_adam)


# Scheduler fields and the config fields they come from, to name what differs on resume.
SCHEDULER_FIELDS = {"max_lr": "train.lr", "min_lr": "train.min_lr", "lr_warmup_steps": "train.lr_warmup_iters",
                    "lr_decay_steps": "train.lr_decay_iters (or the stage's total steps)",
                    "lr_decay_style": "train.lr_decay_style", "start_wd": "train.weight_decay",
                    "end_wd": "train.weight_decay"}


def is_distributed_optimizer(optimizer: Any) -> bool:
    return any(_is_distributed(inner) for inner in _leaves(optimizer))


def init_optimizer_state(optimizer: Any) -> None:
    """Fix 1: give every parameter of an Adam optimizer the state Adam's first step would create (zero
    moments, step 0), so that sharded state dicts can be built before the first step. A no-op once
    stepped, and numerically neutral: Adam starts from exactly these values."""
    for inner in _leaves(optimizer):
        torch_optimizer = inner.optimizer
        if torch_optimizer is None or not isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if "step" not in state:
                    state["step"] = _step_tensor(0.0, group, param)


def reset_optimizer_states(optimizer: Any) -> None:
    """slime's --reset-optimizer-states: every Adam step count and moment back to zero (at a rollout's end),
    as if the optimizer were new; parameters and the LR schedule are left as they are."""
    for inner in _leaves(optimizer):
        torch_optimizer = inner.optimizer
        if torch_optimizer is None:
            continue
        for group in torch_optimizer.param_groups:
            if "step" in group:
                group["step"] = 0
        for state in torch_optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key].zero_()


def untie_adam_steps(optimizer: Any) -> None:
    """Fix 3: each parameter gets its own `step` tensor (megatron's load assigns one shared tensor)."""
    for inner in _leaves(optimizer):
        if inner.optimizer is None:
            continue
        for state in inner.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()  # same device: the load hook placed it


def restore_zero_steps(loaded: Any) -> None:
    """Fix 4: in an optimizer state dict loaded from a checkpoint (nested as megatron's optimizers nest it), a
    `state` of Adam moments without any step gets megatron's `common_step` 0, which its `load_state_dict` hands
    to every parameter (the step an optimizer has before its first step)."""
    if isinstance(loaded, list):
        for item in loaded:
            restore_zero_steps(item)
        return
    if not isinstance(loaded, dict):
        return
    state = loaded.get("state")
    if isinstance(state, dict) and "common_step" not in state and any(
            isinstance(v, dict) and "exp_avg" in v and "step" not in v for v in state.values()):
        state["common_step"] = torch.tensor(0.0)
    for value in loaded.values():
        if isinstance(value, dict | list):
            restore_zero_steps(value)


def _set_main_param_and_states(self: Any, model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
    """Fix 2: DistributedOptimizer's setter, without autograd and leaving `step` alone (megatron restores
    it from the param groups of the checkpoint's common state just before)."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    with torch.no_grad():
        main_param.copy_(tensors["param"])
        for key, value in self.optimizer.state[main_param].items():
            if key != "step" and key in tensors:  # the step comes from the common state's param groups
                value.copy_(tensors[key])


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron (chained) optimizer, whose param groups hold the fp32 main
    parameters under mixed precision and whose state holds the moments."""
    return [inner.optimizer for inner in _leaves(optimizer)
            if getattr(inner, "optimizer", None) is not None and not getattr(inner, "is_stub_optimizer", False)]


def _leaves(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)
