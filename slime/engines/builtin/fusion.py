"""Fused projections for the slot decoder: q/k/v as one GEMM, gate/up as one GEMM, per layer.

At decode sizes (one token per row, a few hundred rows) a projection GEMM is a few microseconds of
mostly fixed cost, and a replayed decode graph runs every one of them: q_proj, k_proj, v_proj and
their biases are three GEMMs where one would do, gate_proj and up_proj two. So, once at engine start,
each group's weights (and biases, when every member has one) are copied into ONE contiguous buffer
`[sum of out_features, in_features]`, and each module's parameter is made a view into its rows
(`param.data = buffer[rows]`). Nothing is copied at run time, and every existing writer keeps working:
weight updates (disk, tensor, distributed), the LoRA merge and the weights checker copy *into* the
parameters, so they write the shared buffer; the `transformers` forward (prefill) reads the views.

What replaces `.data` instead of writing into it breaks the views. The engine's memory release does
(`slime.offload.HostParking` moves tensors by assigning `.data`): so it parks the fused buffers
themselves (`slots`, one DMA each, the views re-pointed on every move) instead of their members, and
the slot decoder re-ties (`ensure_tied`, a copy) any group whose views it finds broken before it
captures graphs over them.

A group is fused only when its members share input size, dtype and device and have all or none of the
biases; otherwise it is left to the modules (logged once, naming the group). `--disable-fused-projections`
keeps every module unfused. A layer whose MLP is a sparse MoE block (Qwen3-MoE, GLM-4.5; moe.py) does not fuse its
experts' gate/up (they are one fused parameter already, `gate_up_proj`); where the block has a shared expert
(GLM-4.5's `shared_experts`, a dense gate/up/down MLP) that expert's gate/up is the layer's fused gate/up group.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from slime.engines.builtin.moe import is_moe_block
from slime.offload import Slot, module_slots

logger = logging.getLogger(__name__)

ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


def fusion_obstacle(modules: Sequence[Any]) -> str | None:
    """None when `modules` can share one weight buffer, else why not."""
    if not all(isinstance(m, torch.nn.Linear) for m in modules):
        return "not all torch.nn.Linear"
    first = modules[0].weight
    if any(m.weight.shape[1] != first.shape[1] for m in modules):
        return "different input sizes"
    if any(m.weight.dtype != first.dtype or m.weight.device != first.device for m in modules):
        return "different dtypes or devices"
    if len({m.bias is None for m in modules}) > 1:
        return "some have a bias, some not"
    return None


class FusedLinear:
    """Linear modules of one input whose weights (and biases) are row blocks of one buffer."""

    def __init__(self, modules: Sequence[torch.nn.Linear]) -> None:
        self.modules = tuple(modules)
        self.sizes = tuple(m.weight.shape[0] for m in self.modules)
        self.retie()

    def retie(self) -> None:
        """Copy the members' present values into new buffers and view them (at start, and after something
        replaced their `.data`)."""
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in self.modules])
            has_bias = self.modules[0].bias is not None
            self.bias = torch.cat([m.bias.detach() for m in self.modules]) if has_bias else None
        self._view()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every member's output (views of one GEMM's result), in the members' order."""
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def _view(self) -> None:
        """Point each member's parameters at its rows of the buffers."""
        start = 0
        for module, size in zip(self.modules, self.sizes, strict=True):
            module.weight.data = self.weight[start:start + size]
            if self.bias is not None:
                module.bias.data = self.bias[start:start + size]
            start += size

    def tied(self) -> bool:
        """Whether every member's parameters still are views into the buffers."""
        start = 0
        for module, size in zip(self.modules, self.sizes, strict=True):
            pairs = [(module.weight, self.weight)] + ([(module.bias, self.bias)] if self.bias is not None else [])
            for param, buffer in pairs:
                expected = buffer[start:start + size]
                if param.device != buffer.device or param.data_ptr() != expected.data_ptr() \
                        or param.shape != expected.shape or param.stride() != expected.stride():
                    return False
            start += size
        return True

    def slots(self, key: tuple) -> Iterator[Slot]:
        """The buffers as parking slots: moving one re-points the members' views at its new place."""
        yield (*key, "weight"), lambda: self.weight, self._put_weight
        if self.bias is not None:
            yield (*key, "bias"), lambda: self.bias, self._put_bias

    def _put_weight(self, value: torch.Tensor) -> None:
        self.weight = value
        self._view()

    def _put_bias(self, value: torch.Tensor) -> None:
        self.bias = value
        self._view()


class ProjectionFusion:
    """Every layer's fused q/k/v (`attention[i]`) and gate/up (`mlp[i]`), None where a group is not fused."""

    def __init__(self, model: Any) -> None:
        self.attention: list[FusedLinear | None] = []
        self.mlp: list[FusedLinear | None] = []
        self.names: set[str] = set()  # the parameter names the buffers hold (parked through `slots`)
        name_of = {id(p): n for n, p in model.named_parameters()}
        refused: dict[str, str] = {}
        for i, layer in enumerate(model.model.layers):
            for kind, owner, names, out in (("q/k/v", layer.self_attn, ATTENTION, self.attention),
                                            ("gate/up", layer.mlp, MLP, self.mlp)):
                if kind == "gate/up" and is_moe_block(owner):  # the experts' gate/up are fused already
                    owner = getattr(owner, "shared_experts", None)  # GLM-4.5: fuse its shared expert's
                    if owner is None:
                        out.append(None)
                        continue
                modules = [getattr(owner, name, None) for name in names]
                reason = "missing modules" if None in modules else fusion_obstacle(modules)
                if reason is not None:
                    refused.setdefault(kind, f"layer {i}: {reason}")
                    out.append(None)
                    continue
                self.names.update(name_of[id(p)] for m in modules for p in (m.weight, m.bias) if p is not None)
                out.append(FusedLinear(modules))
        fused = [kind for kind, groups in (("q/k/v", self.attention), ("gate/up", self.mlp)) if any(groups)]
        logger.info("fused projections: %s in %d layers%s", " and ".join(fused) or "none", len(self.attention),
                    "".join(f"; {kind} left unfused ({why})" for kind, why in refused.items()))

    def groups(self) -> Iterator[tuple[tuple, FusedLinear]]:
        for i, (attention, mlp) in enumerate(zip(self.attention, self.mlp, strict=True)):
            if attention is not None:
                yield ("fused", i, "qkv"), attention
            if mlp is not None:
                yield ("fused", i, "gate_up"), mlp

    def ensure_tied(self) -> int:
        """Re-tie every group whose views were broken (see the module docstring); how many were."""
        broken = [group for _, group in self.groups() if not group.tied()]
        for group in broken:
            group.retie()
        if broken:
            logger.warning("%d fused projection groups had lost their views (parameters' .data replaced); re-tied",
                           len(broken))
        return len(broken)

    def slots(self) -> Iterator[Slot]:
        """The fused buffers as parking slots (their members' parameters are not to be parked themselves)."""
        for key, group in self.groups():
            yield from group.slots(key)


def weight_slots(model: torch.nn.Module, fusion: ProjectionFusion | None) -> list[Slot]:
    """What a memory release parks: the fused buffers, then every other parameter and buffer of `model`."""
    if fusion is None:
        return list(module_slots(model))
    return [*fusion.slots(), *(slot for slot in module_slots(model) if slot[0] not in fusion.names)]
