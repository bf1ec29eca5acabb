"""What each tensor-parallel rank of the built-in engine holds: Megatron-style splits of a `transformers` model.

With `--tp-size N` every rank loads the whole HF checkpoint, then keeps its slice of each split tensor
(`shard_parameters`) and sums the partial outputs of the row-parallel layers over the ranks
(`install_all_reduce`), so that the rest of the engine (the slot decoder, the `transformers` forward of the
prefill, the weight updates) runs unchanged on every rank over its own slices:

* attention: q_proj, k_proj, v_proj column-parallel by heads (rows of the weight and bias: rank r holds query heads
  [r H/N, (r+1) H/N) and key/value heads [r K/N, (r+1) K/N), so each rank's query heads keep their own KV heads,
  GQA groups intact); o_proj row-parallel (columns of the weight), its output summed over the ranks (all-reduce),
  its bias added once after the sum. Both H and K must be divisible by N: KV heads are split, never replicated
  (`check_engine_tp` in slime/config/layout.py, which the RL stage also runs on the config before anything
  starts). Qwen3's q/k norms act per head ([head_dim] weights): replicated.
* dense MLP: gate_proj and up_proj column-parallel (rows), down_proj row-parallel + all-reduce.
* MoE (Qwen3-MoE, GLM-4.5; moe.py): every rank holds every expert, each expert's intermediate dimension split (rows
  of the gate and of the up half of the fused `gate_up_proj` [E, 2I, H], columns of `down_proj` [E, H, I]), the
  block's output summed over the ranks. The router is replicated: every rank routes the same tokens to the same experts
  (its input is the all-reduced residual stream, equal on every rank), so no token moves between ranks (unlike
  expert parallelism, which would need an all-to-all). GLM-4.5 (`glm4_moe`): the router's expert bias is replicated
  too; the shared expert (`mlp.shared_experts.{gate,up,down}_proj`) is split as a dense MLP by its names; the slot
  decoder adds its partial output to the routed experts' before the block's one all-reduce (slots.py), the
  `transformers` forward sums it in its own `RowParallelLinear`.
* embeddings, norms, lm_head: replicated. Every rank computes the full logits; only rank 0 samples from them.
  A vocab-parallel lm_head (and its gather) would save each rank V/N x H of weight reads: not done yet.

The split rule of a tensor follows from its HF name alone (`split_rule`), so the same rule shards the model at
start and every full HF tensor a weight update sends, per-expert names included (`experts.{e}.gate_proj.weight`
is a block of the fused `gate_up_proj`: its rows are split as the fused tensor's are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from slime.engines.builtin.moe import is_fused_experts
from slime.errors import ConfigError

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split: weight and bias rows
ROW = ("o_proj", "down_proj")  # input features split: weight columns; the bias is replicated

Rule = tuple[int, int]  # (dim split, halves): a tensor of `halves` equal blocks along `dim`, each split over ranks


def split_rule(name: str) -> Rule | None:
    """How the HF tensor `name` is split over the ranks: (dim, halves), or None when every rank holds all of it.
    `halves` is 2 for a fused experts `gate_up_proj` (gate rows, then up rows: each half split on its own)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    owner, leaf = parts[-2], parts[-1]
    if owner == "experts" and leaf == "gate_up_proj":  # [E, 2I, H]
        return 1, 2
    if owner == "experts" and leaf == "down_proj":  # [E, H, I]
        return 2, 1
    if owner in COLUMN and leaf in ("weight", "bias"):
        return 0, 1
    if owner in ROW and leaf == "weight":
        return 1, 1
    return None


def shard(tensor: torch.Tensor, rule: Rule, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s slice of the full `tensor` under `rule` (a view where one slice suffices)."""
    dim, halves = rule
    size = tensor.shape[dim]
    if size % (halves * world):
        raise ConfigError(f"--tp-size {world}: dimension {dim} of size {size} cannot be split in {world} equal "
                          f"parts{' per half' if halves > 1 else ''}")
    block = size // halves
    part = block // world
    pieces = [tensor.narrow(dim, h * block + rank * part, part) for h in range(halves)]
    return pieces[0] if halves == 1 else torch.cat(pieces, dim=dim)


def full_shape(name: str, shape: torch.Size | tuple[int, ...], world: int) -> tuple[int, ...]:
    """The HF (unsplit) shape of tensor `name`, of which one rank holds `shape`."""
    rule = split_rule(name)
    if rule is None or world == 1:
        return tuple(shape)
    out = list(shape)
    out[rule[0]] *= world
    return tuple(out)


def shard_parameters(model: torch.nn.Module, rank: int, world: int) -> int:
    """Keep only rank `rank`'s slice of every split parameter of `model`, in place (new, contiguous storage: the
    full tensors are freed); how many were split. Run before the projections are fused (fusion.py)."""
    split = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            rule = split_rule(name)
            if rule is None:
                continue
            try:
                param.data = shard(param.data, rule, rank, world).contiguous().clone()
            except ConfigError as exc:
                raise ConfigError(f"{name} {list(param.shape)}: {exc}") from None
            split += 1
    return split


class RowParallelLinear(torch.nn.Linear):
    """A row-parallel linear layer: this rank's input columns, the partial products summed over the ranks
    (`reduce`, in place), then the (replicated) bias added once. Takes over the parameters of the `nn.Linear`
    it replaces, so their names (`...o_proj.weight`) and storage stay those the weight updates write."""

    def __init__(self, linear: torch.nn.Linear, reduce: Callable[[torch.Tensor], None]) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.weight.shape[1], linear.weight.shape[0]
        self.weight = linear.weight
        self.bias = linear.bias
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        self.reduce(out)
        return out if self.bias is None else out + self.bias


def install_all_reduce(model: torch.nn.Module, reduce: Callable[[torch.Tensor], None]) -> int:
    """Make the sharded `model` sum its row-parallel outputs over the ranks: every o_proj / down_proj linear becomes a
    `RowParallelLinear`, and every fused experts module sums its output (a forward hook, for the `transformers`
    forward; the slot decoder's own MoE dispatch sums explicitly). How many modules were changed."""
    changed = 0
    for _, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in ROW and type(child) is torch.nn.Linear:
                setattr(module, child_name, RowParallelLinear(child, reduce))
                changed += 1
        if is_fused_experts(module):
            def summed(_module: Any, _args: Any, output: torch.Tensor) -> torch.Tensor:
                reduce(output)
                return output

            module.register_forward_hook(summed)
            changed += 1
    return changed
