"""Mixture-of-experts layers for the built-in engine (Qwen3-MoE, GLM-4.5): routing, expert dispatch, routed-expert
records.

A `transformers` 5.x `Qwen3MoeSparseMoeBlock` (`layer.mlp`) holds a router (`mlp.gate`, a `Qwen3MoeTopKRouter`:
`weight` [E, H]) and the experts as two fused 3-D parameters (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
first, and `mlp.experts.down_proj` [E, H, I]). A GLM-4.5 `Glm4MoeMoE` (`glm4_moe`) has the same experts, a
`Glm4MoeTopkRouter` (`weight` [E, H] kept in fp32, and an expert bias buffer `e_score_correction_bias` [E]) and a
shared expert (`mlp.shared_experts`, a dense gate/up/down MLP of `moe_intermediate_size * n_shared_experts`) whose
output is added to the routed experts'. Its first `first_k_dense_replace` layers are dense MLPs (no router). The
slot decoder (slots.py) runs the block with these functions over the module's own parameters, so in-place weight
updates apply at once:

* `route`: the router's choice, by the same operations, in the same order and dtypes, as the `transformers`
  router's forward, so the chosen ids equal `transformers`' for equal inputs (on CUDA, `topk(sorted=False)` may
  list a token's k ids in another order than on CPU; the set is the same):
  - Qwen3-MoE (`Qwen3MoeTopKRouter`): logits -> fp32 softmax -> top-k -> (with `norm_topk_prob`) renormalised,
    cast to the logits' dtype.
  - GLM-4.5 (`Glm4MoeTopkRouter`, `biased_router`): fp32 logits -> sigmoid scores; the *choice* adds the expert
    bias: with `n_group` groups of E / n_group experts, each group scored by the sum of its two best biased
    scores, only the `topk_group` best groups' experts stay eligible, then the k best biased scores among them
    (`topk(sorted=False)`, as `transformers`); the *weights* are the unbiased sigmoid scores of the chosen ids,
    (with `norm_topk_prob`) divided by their sum + 1e-20, times `routed_scaling_factor`: fp32 whatever the
    model's dtype (as `transformers`, whose experts then multiply their bf16 outputs by them in fp32).
* `experts_forward`: the (token, slot) pairs grouped by expert (a stable sort of the expert ids), each expert's
  gate/up, SiLU x up and down over its contiguous slice, weighted, put back in (token, slot) order by the inverse
  permutation and summed over the k slots (as `transformers`' grouped_mm path: deterministic, where an
  `index_add_` scatter uses atomics on CUDA). Three formulations of the expert GEMMs (`mode`):
  - "sorted": a Python loop over the experts that received tokens (never over tokens), their slices read from
    one host copy of the counts. Eager only (the counts are a host sync): CPU, and the CUDA prefill when no
    grouped GEMM is available.
  - "grouped": one `torch.nn.functional.grouped_mm` (or `torch._grouped_mm`) per projection, the group offsets
    computed on the device (a scatter-add count + cumsum). Every shape depends only on tokens x k, so it can be
    captured in a CUDA graph. Used on CUDA for bf16 weights on sm80+ where the op exists (`grouped_available`).
  - "dense": every expert on every token (`bmm` over [E, N, ...]), the outputs weighted by a dense [N, E] routing
    matrix that is zero off the top-k. Capture-safe on any device and dtype, at E/k times the expert FLOPs: the
    CUDA-graph decode step's fallback where grouped GEMMs are not available (decode batches are small, and at
    decode every expert's weights are read anyway once batch x k reaches E).
  `dispatch_modes` picks them: (decode step, prefill).

The shared expert (GLM-4.5) runs as a dense MLP over every token (`shared_expert_forward`, its gate/up fused into
one GEMM where the scheduler fused projections) and is added to the routed output before the tensor-parallel
all-reduce, so one all-reduce sums both partial outputs (slots.py).

`check_moe_config` refuses, at engine start and naming the field, what these functions cannot compute (groups that
do not divide the experts, more eligible experts asked than the groups hold, a router of another layout).

Checkpoints and trainers name the experts one by one, as SGLang's loader takes them
(`...mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`: what `save_pretrained` writes and slime's
Megatron-to-HF conversion sends): `expert_aliases` maps each such name to its block of the fused parameter, so the
weight updates (weights.py) write there in place. The model's own fused names are accepted as well.

The routed experts of a sequence (SGLang's `return_routed_experts`) are one [L, k] int32 record per fed token,
L = `num_hidden_layers` (as SGLang's capturer); a layer that has no router (a dense `mlp_only_layers` layer) holds
-1. `encode_routed_experts` gives SGLang's wire format: base64 of the little-endian int32 C-order array
[tokens, L, k]. For the `transformers` forward (the scheduler's dynamic KV cache, prompt scoring,
`--disable-slot-prefill`), `capture_routing` records what its own routers chose (forward hooks).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from slime.errors import ConfigError

MODES = ("sorted", "grouped", "dense")
NO_EXPERT = -1  # a layer without a router, in a routed-experts record


def is_moe_block(mlp: Any) -> bool:
    """Whether `mlp` is a sparse MoE block of the `transformers` Qwen3-MoE layout (a router `gate` with a
    `top_k`, and experts with fused 3-D `gate_up_proj` / `down_proj` parameters)."""
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    return (gate is not None and hasattr(gate, "top_k") and isinstance(getattr(gate, "weight", None), torch.Tensor)
            and is_fused_experts(experts))


def is_fused_experts(module: Any) -> bool:
    """Whether `module` holds its experts as fused 3-D parameters (`transformers` 5.x `Qwen3MoeExperts`)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 \
        and down.dim() == 3


def moe_layers(model: Any) -> list[bool]:
    """One flag per decoder layer of `model` (`model.model.layers`; none for another layout): True where its MLP
    is a sparse MoE block."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [is_moe_block(getattr(layer, "mlp", None)) for layer in layers]


def biased_router(gate: Any) -> bool:
    """Whether `gate` is a GLM-4.5 (DeepSeek-V3-style) router: sigmoid scores, an expert bias for the choice,
    group-limited top-k, `routed_scaling_factor` (`Glm4MoeTopkRouter`)."""
    return isinstance(getattr(gate, "e_score_correction_bias", None), torch.Tensor)


def check_moe_config(config: Any) -> None:
    """ConfigError naming the field when `config` describes a MoE router the engine cannot run (before any weight
    is read): GLM-4.5's groups must divide the routed experts, hold at least two experts each (a group's score is
    the sum of its two best), `topk_group` must lie in [1, n_group], and the eligible groups must hold at least
    `num_experts_per_tok` experts."""
    if getattr(config, "model_type", None) != "glm4_moe":
        return
    experts, groups = config.n_routed_experts, config.n_group
    topk_group, top_k = config.topk_group, config.num_experts_per_tok
    where = f"{config.model_type} config"
    if not isinstance(groups, int) or groups < 1 or experts % groups:
        raise ConfigError(f"{where}: n_group {groups} does not divide n_routed_experts {experts} (each group holds "
                          "n_routed_experts / n_group experts)")
    if experts // groups < 2:
        raise ConfigError(f"{where}: n_group {groups} leaves {experts // groups} expert per group; a group is scored "
                          "by the sum of its two best experts' scores, so each group needs at least 2")
    if not 1 <= topk_group <= groups:
        raise ConfigError(f"{where}: topk_group {topk_group} must lie in [1, n_group={groups}]")
    if not 1 <= top_k <= topk_group * (experts // groups):
        raise ConfigError(f"{where}: num_experts_per_tok {top_k} must lie in [1, {topk_group * (experts // groups)}] "
                          f"(the experts of the topk_group={topk_group} groups kept, {experts // groups} each)")
    if (getattr(config, "n_shared_experts", 0) or 0) < 0:
        raise ConfigError(f"{where}: n_shared_experts {config.n_shared_experts} must be >= 0")


def moe_top_k(model: Any) -> int:
    """The experts each token is routed to (the first MoE layer's router's k); 0 for a model without MoE layers."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return next((int(layer.mlp.gate.top_k) for layer in layers if is_moe_block(getattr(layer, "mlp", None))), 0)


def route(gate: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for `x` [N, H]: weights [N, k] (the logits' dtype: fp32 for GLM-4.5) and expert ids
    [N, k] (int64).

    Qwen3-MoE, as `Qwen3MoeTopKRouter.forward` (transformers 5.24): logits = x W^T; p = softmax(logits) in fp32; the
    k largest p (ids in descending p); with `norm_topk_prob` divided by their sum; cast to the logits' dtype. GLM-4.5:
    `route_biased` (a router with an expert bias)."""
    if biased_router(gate):
        return route_biased(gate, x)
    logits = F.linear(x, gate.weight)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, gate.top_k, dim=-1)
    if gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_biased(gate: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GLM-4.5 router's choice for `x` [N, H]: weights [N, k] fp32 and expert ids [N, k], as
    `Glm4MoeTopkRouter.forward` (transformers 5.24), operation by operation (see the module docstring). When every
    group is kept (`topk_group == n_group`, GLM-4.5's own n_group = topk_group = 1) the group mask keeps every
    expert, so it is skipped: the same ids and weights, five fewer kernels per MoE layer of a decode step."""
    logits = F.linear(x.to(torch.float32), gate.weight.to(torch.float32))  # [N, E]
    scores = logits.sigmoid()
    choice = scores + gate.e_score_correction_bias  # the bias picks the experts; it weighs nothing
    experts, groups = choice.shape[-1], gate.num_group
    if gate.topk_group < groups:
        group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [N, G]
        kept = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1)
        eligible = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
        choice = choice.masked_fill(~eligible.bool(), float("-inf"))
    ids = torch.topk(choice, k=gate.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * gate.routed_scaling_factor, ids


def shared_expert_forward(shared: Any, x: torch.Tensor, gate_up: Any = None, silu_mul: Any = None) -> torch.Tensor:
    """The shared expert (GLM-4.5's `shared_experts`, a gate/up/down MLP) over x [N, H], *without* its down
    projection's tensor-parallel sum (the caller adds it to the routed experts' partial output and sums both with one
    all-reduce) and without the down projection's bias (GLM-4.5's has none; a caller adds one after that sum).
    `gate_up`: the scheduler's fused gate/up projection
    (fusion.py) or None; `silu_mul`: the compiled SiLU x up (slots.py) or None for the module's activation."""
    gate, up = gate_up(x) if gate_up is not None else (shared.gate_proj(x), shared.up_proj(x))
    hidden = silu_mul(gate, up) if silu_mul is not None else shared.act_fn(gate) * up
    return F.linear(hidden, shared.down_proj.weight)


def grouped_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the "grouped" dispatch may run here: CUDA sm80+, bf16 weights (the dtype the CUDA grouped GEMM
    kernels take), and the op exists in this torch."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def dispatch_modes(device: torch.device, dtype: torch.dtype, cuda_graphs: bool) -> tuple[str, str]:
    """(the decode step's mode, the prefill's mode): the decode step must be capturable when it is captured
    ("grouped" where available, else "dense"); the eager prefill takes "grouped" or "sorted"."""
    grouped = grouped_available(device, dtype)
    prefill = "grouped" if grouped else "sorted"
    if device.type == "cuda" and cuda_graphs:
        return ("grouped" if grouped else "dense"), prefill
    return prefill, prefill


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] (rows sorted by group) times each group's `weight[g]` [out, in] transposed: [S, out]."""
    op = F.grouped_mm if hasattr(F, "grouped_mm") else torch._grouped_mm
    return op(x, weight.transpose(-2, -1), offs=offsets)


def experts_forward(experts: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    mode: str = "sorted") -> torch.Tensor:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) for x [N, H]: [N, H] in x's dtype (see the module docstring
    for `mode`). An expert is down(act(gate(x)) * up(x)) with gate/up the two halves of `gate_up_proj[e]`."""
    gate_up, down, act = experts.gate_up_proj, experts.down_proj, experts.act_fn
    tokens, k = ids.shape
    if mode == "dense":
        hidden = torch.matmul(x.unsqueeze(0), gate_up.transpose(1, 2))  # [E, N, 2I]
        gate, up = hidden.chunk(2, dim=-1)
        out = torch.bmm(act(gate) * up, down.transpose(1, 2))  # [E, N, H]
        dense = torch.zeros(tokens, gate_up.shape[0], dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
        return (out * dense.t().unsqueeze(-1)).sum(dim=0).to(x.dtype)
    if mode not in MODES:
        raise ValueError(f"MoE dispatch mode {mode!r}: one of {', '.join(MODES)}")
    flat = ids.reshape(-1)  # [S = N k], pair p = token p // k, slot p % k
    order = torch.argsort(flat, stable=True)  # the pairs grouped by expert
    picked = x[order // k]  # [S, H]
    if mode == "grouped":
        counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # no host sync, fixed shape
        offsets = counts.cumsum(0, dtype=torch.int32)
        gate, up = _grouped_mm(picked, gate_up, offsets).chunk(2, dim=-1)
        out = _grouped_mm(act(gate) * up, down, offsets)  # [S, H]
    else:
        out = torch.empty_like(picked)
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=gate_up.shape[0]).tolist()):
            if count:
                rows = slice(start, start + count)
                gate, up = F.linear(picked[rows], gate_up[expert]).chunk(2, dim=-1)
                out[rows] = F.linear(act(gate) * up, down[expert])
                start += count
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(out)
    unsorted[order] = out  # back to (token, slot) order
    return unsorted.view(tokens, k, -1).sum(dim=1).to(x.dtype)


def expert_aliases(model: torch.nn.Module) -> dict[str, tuple[str, int, slice | None]]:
    """Per-expert HF names -> (the fused parameter's name, expert index, rows of it or None for all):
    `P.{e}.gate_proj.weight` -> (`P.gate_up_proj`, e, [0, I)), `P.{e}.up_proj.weight` -> (`P.gate_up_proj`, e,
    [I, 2I)), `P.{e}.down_proj.weight` -> (`P.down_proj`, e, None), for every fused experts module `P`."""
    aliases: dict[str, tuple[str, int, slice | None]] = {}
    for prefix, module in model.named_modules():
        if not is_fused_experts(module):
            continue
        experts, rows = module.gate_up_proj.shape[:2]
        half = rows // 2
        for e in range(experts):
            aliases[f"{prefix}.{e}.gate_proj.weight"] = (f"{prefix}.gate_up_proj", e, slice(0, half))
            aliases[f"{prefix}.{e}.up_proj.weight"] = (f"{prefix}.gate_up_proj", e, slice(half, rows))
            aliases[f"{prefix}.{e}.down_proj.weight"] = (f"{prefix}.down_proj", e, None)
    return aliases


def routing_record(per_layer: list[torch.Tensor | None], top_k: int) -> torch.Tensor:
    """Stack the ids [..., k] of each layer (None: a layer without a router, -1) into one int32 record
    [..., L, k]."""
    like = next(ids for ids in per_layer if ids is not None)
    filled = [ids.to(torch.int32) if ids is not None
              else torch.full((*like.shape[:-1], top_k), NO_EXPERT, dtype=torch.int32, device=like.device)
              for ids in per_layer]
    return torch.stack(filled, dim=-2)


@contextlib.contextmanager
def capture_routing(model: Any) -> Iterator[list[torch.Tensor | None]]:
    """While open, every forward of `model`'s routers is recorded: yields a list, one entry per decoder layer,
    set to that layer's last router ids [tokens, k] (None for a layer without a router). These are the ids the
    `transformers` forward itself dispatched on (`Qwen3MoeTopKRouter` returns logits, weights, ids)."""
    layers = model.model.layers
    seen: list[torch.Tensor | None] = [None] * len(layers)
    handles = []
    for i, layer in enumerate(layers):
        if is_moe_block(layer.mlp):
            def keep(_module: Any, _args: Any, output: Any, i: int = i) -> None:
                seen[i] = output[2]
            handles.append(layer.mlp.gate.register_forward_hook(keep))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def encode_routed_experts(chunks: list[torch.Tensor], start: int, end: int) -> str:
    """SGLang's `meta_info["routed_experts"]`: base64 of the records [start, end) of `chunks` (host int32
    tensors [n_i, L, k], in token order) as a little-endian int32 C-order array [end - start, L, k]."""
    records = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int32)
    if records.shape[0] < end or not 0 <= start <= end:
        raise RuntimeError(f"routed experts: {records.shape[0]} token records, asked for [{start}, {end}) "
                           "(the engine lost track of a request's routing)")
    array = np.ascontiguousarray(records[start:end].numpy(), dtype="<i4")
    return base64.b64encode(array.tobytes()).decode("ascii")
