"""A slot KV cache and a graph-captured decode step for the built-in engine (Qwen2, Qwen3, Qwen3-MoE, GLM-4.5,
Llama).

The generic path of the scheduler (a `transformers` forward over a left-padded `DynamicCache`) pays,
at every decode step, for concatenating the cache, a Python-level model forward (hundreds of kernel
launches) and re-padding whenever rows join or leave. On a GPU that is launch-bound: ~3k tokens/s.

Here every running request owns a *slot*: row `s` of a preallocated cache `[slots, kv_heads,
max_len, head_dim]` per layer, holding its tokens at positions `0 .. n-1`. Running requests occupy
slots `0 .. B-1` (when one finishes, the last running slot moves into the hole), so a decode step
works on the first B rows only. Prompts are prefilled by the decode step's own layer body run over the
whole prompts (`prefill`: right-padded together, causal attention), which writes each layer's keys/values
straight into the slots and runs the LM head on each prompt's last position only. Where the scheduler
keeps the `transformers` forward instead (prompt scoring, `--disable-slot-prefill`), the keys/values of
its `DynamicCache` are copied into the slots (`write_prefill`).

The decode step (and the prefill: one layer body, `_layers`, serves a step's one token per row and a
prompt's n) is written against the modules of the `transformers` model (its projections, norms,
rotary embedding and MLP, so the weights are shared and in-place weight updates apply at once):
embed -> per layer (norm, q/k/v, optional q/k norm, rotary, write k/v at each row's position,
attention over the row's valid positions, o_proj, residual, norm, MLP, residual) -> norm -> lm_head.
Its tensor shapes depend only on (batch bucket, length bucket), so on CUDA each such pair is captured
once as a CUDA graph and replayed: one launch per step. Rows past B in a bucket compute on free
slots and are ignored. On CPU the same step runs eagerly (used by the tests).

A replayed step still runs every kernel the eager step launches, and at decode sizes each takes a few
microseconds whatever its work: the eager modules launch ~40 per layer (an RMSNorm alone is six
elementwise kernels). On CUDA the elementwise pieces (residual add + RMSNorm, rotary embedding,
SiLU x up) are therefore `torch.compile`d once, with dynamic shapes, into one kernel each before the
graphs are captured (same formulas as the `transformers` modules; `fuse=False` keeps the modules).
And where the scheduler fused the projections (`fusion.py`: each layer's q/k/v weights one buffer,
gate/up another, the modules' parameters views into them), q/k/v is one GEMM and gate/up one, their
outputs split, on CPU as on CUDA (`projections=None` keeps the modules' five GEMMs).
In the decode step the rotary and the two key/value cache writes (`keys[rows, :, positions] = k`, an
advanced-index `index_put_` each) are likewise one compiled function (`rotate_write_kv`, `fuse_kv_write=False`
keeps the compiled rotary and the two writes); the prefill writes contiguous slices and keeps them.

Qwen3-MoE and GLM-4.5 (`glm4_moe`): a layer whose MLP is a sparse MoE block runs it with `moe.py` over the block's
own parameters (its router's top-k: softmax for Qwen3-MoE, GLM-4.5's sigmoid + expert bias + group-limited choice;
then the experts grouped by expert id, no loop over tokens; GLM-4.5's shared expert added, its gate/up one fused
GEMM). GLM-4.5's first `first_k_dense_replace` layers are dense MLPs, run as any dense layer; its partial rotary
(only the first head_dim * partial_rotary_factor dims of each head rotated) is the model module's own
`apply_rotary_pos_emb`, which the slot decoder calls (and compiles) whatever the model. The decode step uses a
dispatch that can be captured in a CUDA graph (grouped GEMMs with device-side offsets on bf16 sm80+, else every
expert on every row, masked), the prefill an eager one (`moe.dispatch_modes`). Every step and prefill also records the experts
each fed token was routed to, [rows, tokens, num_hidden_layers, k] int32 (`last_routing`), from which the
scheduler answers `return_routed_experts`.

Tensor parallelism (`tp`, tp_group.py and tp_shard.py): every rank runs this decoder over its slices of the model
(its query and key/value heads, so its slot cache holds only its own heads; its slice of each MLP or expert), the
row-parallel outputs summed over the ranks inside the layer body (o_proj, down_proj, the MoE block's experts), so
the logits are the same on every rank. Rank 0's decoder announces each prefill, decode step, slot move and prefill
copy, and broadcasts each step's fed tokens from the device; a follower's decoder runs the same calls. On CUDA the
all-reduces are NCCL collectives captured in the decode graphs.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from slime.compiled import compiled
from slime.engines.builtin.fusion import ProjectionFusion
from slime.engines.builtin.moe import (
    biased_router,
    dispatch_modes,
    experts_forward,
    moe_layers,
    moe_top_k,
    route,
    routing_record,
    shared_expert_forward,
)
from slime.engines.builtin.tp_group import TensorParallel

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "glm4_moe", "llama")
MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe")


def slot_support(model: Any) -> str | None:
    """None when `model` can use the slot decoder, else why not."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (slot decoding covers {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return "sliding-window attention"
    if config.model_type in MOE_MODEL_TYPES and not any(moe_layers(model)):
        return f"a {config.model_type} model whose MoE blocks are not the fused-experts layout of transformers 5.x"
    if config.model_type == "glm4_moe":
        for i, (layer, moe) in enumerate(zip(model.model.layers, moe_layers(model), strict=True)):
            if moe != (i >= config.first_k_dense_replace):
                return (f"a glm4_moe model whose layer {i} is {'sparse' if moe else 'not a fused-experts MoE block'} "
                        f"(first_k_dense_replace={config.first_k_dense_replace}: dense layers first, then MoE)")
            if moe and not biased_router(layer.mlp.gate):
                return f"a glm4_moe model whose layer {i} router has no e_score_correction_bias"
    return None


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual + delta` and its RMSNorm, computed as the `transformers` Qwen2/Qwen3/Llama RMSNorm
    does (fp32 statistics, cast back, then the weight); one kernel once compiled."""
    hidden = residual + delta
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return hidden, weight * x.to(hidden.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotate_write_kv_fn(apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., torch.Tensor]:
    """The decode step's rotary + key/value cache write, as one function of the model's `apply_rotary_pos_emb`.

    `rotate_write_kv(q, k, v, cos, sin, keys, values, rows, positions)` takes the step's queries [B, heads, 1, D],
    keys and values [B, kv_heads, 1, D] (unrotated), the rotary tables and one layer's caches [slots, kv_heads,
    max_len, D]; it writes the rotated key and the value of row i at `keys[rows[i], :, positions[i]]` (in place)
    and returns the rotated queries. Eagerly that is the rotary kernel(s) and two `index_put_`; compiled
    (`torch.compile(..., dynamic=True)`, as on CUDA) inductor turns the functionalized `index_put` + copy back
    into a scatter straight into the cache buffers (its re-inplacing pass; a graph-level decision, shared by
    the C++ and Triton backends). Read on CPU (TORCH_LOGS=output_code, torch 2.13): one fused C++ kernel
    (`cpp_fused_add_cat_index_put_mul_neg_select_slice_unsqueeze_0`) that takes both caches as in/out pointers and
    stores only at [row, :, position] (no loop over the caches' slots or length); its only allocations are
    [B, heads|kv_heads, 1, D] (the rotated q it returns and rotate_half's temporaries), no cache-sized buffer and
    no `copy_` (tests/engines/test_fused_kv_write.py reads that code; a `clone` + `copy_` written on purpose
    showed up there as a loop over slots x kv_heads x max_len x D). The C++ backend puts every loop nest of a
    graph in one kernel; this one has six (q's rotate_half halves and rotated q, k's halves, then the k and v
    scatter in one nest). Triton launches loop nests of different shapes as separate kernels unless it fuses
    them, so on CUDA it may be more than one launch (still no index_put_ of its own): not read yet, no GPU here."""

    def rotate_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
        q, k = apply_rotary(q, k, cos, sin)
        keys[rows, :, positions] = k[:, :, 0]
        values[rows, :, positions] = v[:, :, 0]
        return q

    return rotate_write_kv


def _buckets(limit: int, start: int) -> list[int]:
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


class SlotDecoder:
    """The slot cache of one model and its decode step (graph-captured on CUDA)."""

    def __init__(self, model: Any, *, slots: int, max_len: int, device: torch.device, cuda_graphs: bool,
                 fuse: bool = True, projections: ProjectionFusion | None = None,
                 fuse_kv_write: bool = True, tp: TensorParallel | None = None) -> None:
        reason = slot_support(model)
        if reason is not None:
            raise ValueError(f"slot decoding does not support {reason}")
        # tensor parallelism (tp_group.py): rank 0's decoder announces each operation, the followers' run it too
        self.tp = tp
        if tp is not None:
            tp.announce("slots", {"slots": slots, "max_len": max_len, "cuda_graphs": cuda_graphs, "fuse": fuse,
                                  "fuse_kv_write": fuse_kv_write})
        if projections is not None:  # the graphs will read the fused buffers: their views must hold
            if len(projections.attention) != len(model.model.layers):
                raise ValueError(f"projections fused for {len(projections.attention)} layers, the model has "
                                 f"{len(model.model.layers)}")
            projections.ensure_tied()
        self.projections = projections
        self.model = model
        self.slots = slots
        self.max_len = max_len
        self.device = device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        config = model.config
        self.layers = model.model.layers
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        world = tp.world if tp is not None else 1  # this rank's heads (tp_shard.py: whole heads per rank)
        self.heads = config.num_attention_heads // world
        self.kv_heads = config.num_key_value_heads // world
        self.scaling = attention.scaling
        apply_rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        self._rotate = apply_rotary
        self.fused = fuse and self.cuda_graphs
        self._silu_mlp = getattr(config, "hidden_act", None) == "silu"
        if self.fused:  # compiled at the first decode, before any capture (see the module docstring)
            off = ("start the engine with --disable-cuda-graph (the slot decoder compiles its elementwise kernels "
                   "only with CUDA graphs)")
            self._add_norm_fn = compiled(add_rms_norm, off, dynamic=True)
            self._rotate = compiled(self._rotate, off, dynamic=True)
            self._silu_mul = compiled(silu_mul, off, dynamic=True)
        # the decode step's rotary + key/value writes (`rotate_write_kv_fn`): one compiled function, or the
        # rotary above and two `index_put_`
        self.fuse_kv_write = fuse_kv_write and self.fused
        self._rotate_write = (compiled(rotate_write_kv_fn(apply_rotary), "start the engine with --disable-fused-kv-write "
                                       "for the rotary and two cache writes", dynamic=True)
                              if self.fuse_kv_write else rotate_write_kv_fn(self._rotate))
        dtype = next(model.parameters()).dtype
        # MoE layers (moe.py): which layers route, how the decode step and the prefill dispatch their experts
        self.moe = moe_layers(model)
        self.top_k = moe_top_k(model)
        self.moe_decode_mode, self.moe_prefill_mode = dispatch_modes(device, dtype, self.cuda_graphs)
        # the routed experts of the last decode [B, L, k] or prefill [R, W, L, k] (None for a dense model); on CUDA
        # a decode's is a view of the graph's output, valid until the next replay (as its logits)
        self.last_routing: torch.Tensor | None = None
        shape = (slots, self.kv_heads, max_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self._attend = torch.zeros((), dtype=dtype, device=device)  # the additive mask's two values
        self._masked = torch.full((), float("-inf"), dtype=dtype, device=device)
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # the token each row feeds
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # where it goes in its slot
        self.batch_buckets = _buckets(slots, 8) if self.cuda_graphs else []
        self.length_buckets = _buckets(max_len, 128)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self._pool = None
        per_token = 2 * len(self.layers) * self.kv_heads * self.head_dim * self.keys[0].element_size()
        logger.info("slot KV cache: %d slots x %d tokens (%.2f GiB)%s", slots, max_len,
                    slots * max_len * per_token / 2**30, ", CUDA graphs" if self.cuda_graphs else "")

    # ------------------------------------------------------------------ cache bookkeeping

    def write_prefill(self, cache: DynamicCache, rows: list[int], lengths: list[int], first_slot: int) -> None:
        """Copy rows of a left-padded prefill cache into slots `first_slot, first_slot + 1, ...`.

        One gather per layer and tensor (row i's position j reads column `width - n_i + j`), not one
        copy per row: 256 prompts x 24 layers were ~12k tiny kernel launches. Positions past n_i get
        a copy of the row's last column; they lie beyond its length, so decoding masks and then
        overwrites them."""
        if not rows:
            return
        if self.tp is not None:  # a follower copies the cache of the `transformers` prefill it ran last
            self.tp.announce("write_prefill", rows, lengths, first_slot)
        width = cache.layers[0].keys.shape[2]
        index = torch.tensor(rows, device=self.device)
        start = torch.tensor([width - n for n in lengths], device=self.device)
        columns = (start.unsqueeze(1) + torch.arange(width, device=self.device)).clamp(max=width - 1)
        end = first_slot + len(rows)
        for layer, lay in enumerate(cache.layers):
            for source, target in ((lay.keys, self.keys[layer]), (lay.values, self.values[layer])):
                picked = source.index_select(0, index)  # [R, kv_heads, width, head_dim]
                gather = columns[:, None, :, None].expand(-1, picked.shape[1], -1, picked.shape[3])
                target[first_slot:end, :, :width] = picked.gather(2, gather)

    def move(self, src: int, dst: int, length: int) -> None:
        """Slot `src`'s first `length` positions into slot `dst` (compaction after a row finishes)."""
        if self.tp is not None:
            self.tp.announce("move", src, dst, length)
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]

    # ------------------------------------------------------------------ prefill

    def prefill(self, prompts: list[list[int]], first_slot: int) -> torch.Tensor:
        """Prefill `prompts` straight into slots `first_slot, first_slot + 1, ...`: logits [R, V] of each
        prompt's last position, in the model's dtype (as `decode`'s).

        The layers run the decode step's own body (`_layers`: fused projections, the compiled add+RMSNorm,
        rotary and SiLU x up where `fused`, Qwen3's q/k norms) over the prompts right-padded to the longest,
        at positions 0 .. width-1 of every row, eagerly (no graph: the shapes vary with every group). Attention
        is causal over each row (`is_causal=True`, no mask): with right padding a real position j < n_i only
        sees keys 0 .. j, all real, so unequal lengths need no mask; the padded positions compute garbage that
        nothing reads. Each layer's keys/values go straight into the slot rows at positions 0 .. width-1 (the
        padded tail lies past the row's length: decoding masks it, then overwrites it), so there is no
        `DynamicCache` and no `write_prefill` copy, and the LM head runs on each prompt's last position only."""
        rows, width = len(prompts), max(len(p) for p in prompts)
        end = first_slot + rows
        if end > self.slots or width > self.max_len or min(len(p) for p in prompts) == 0:
            raise ValueError(f"prefill of {rows} prompts of up to {width} tokens into slots {first_slot}..{end - 1}: "
                             f"the cache has {self.slots} slots of {self.max_len} positions (and no prompt may be empty)")
        if self.tp is not None:
            self.tp.announce("prefill", prompts, first_slot)
        model = self.model.model
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        hidden = model.embed_tokens(ids)  # [R, W, H]
        cos, sin = model.rotary_emb(hidden, torch.arange(width, device=self.device).unsqueeze(0))  # [1, W, D]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.keys[layer][first_slot:end, :, :width] = k
            self.values[layer][first_slot:end, :, :width] = v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                                 enable_gqa=self.heads != self.kv_heads)  # [R, heads, W, D]
            return out.transpose(1, 2).reshape(rows, width, self.heads * self.head_dim)

        routing: list[torch.Tensor | None] = []
        x = self._layers(hidden, cos, sin, attend, moe_mode=self.moe_prefill_mode, routing=routing)
        self.last_routing = routing_record(routing, self.top_k) if any(self.moe) else None
        return self.model.lm_head(x[torch.arange(rows, device=self.device), last])

    # ------------------------------------------------------------------ decode

    def decode(self, tokens: torch.Tensor | None, positions: list[int]) -> torch.Tensor:
        """Logits [B, V] for feeding `tokens[i]` at `positions[i]` of slot i, i < B, in the model's dtype: the
        sampler reads them in fp32 (compiled, inside its own kernels), so no fp32 copy of the step's logits is
        made here. On CUDA they are a view of the graph's output, valid until the next replay: the sampler's
        kernels are queued before it on the same stream (as for an fp32 model, whose `.float()` was a view)."""
        batch = len(positions)
        length = next(b for b in self.length_buckets if b > max(positions))
        if tokens is not None:  # None on a tensor-parallel follower: rank 0's tokens arrive by broadcast
            self.tokens[:batch] = tokens
        if self.tp is not None:  # the tokens stay on the device (no host sync: the overlapped schedule holds)
            self.tp.announce("decode", positions)
            self.tp.broadcast(self.tokens[:batch])
        self.positions[:batch] = torch.tensor(positions, dtype=torch.long)
        if not self.cuda_graphs:
            logits, self.last_routing = self._step(batch, length)
            return logits
        bucket = next(b for b in self.batch_buckets if b >= batch)
        self.tokens[batch:] = 0
        self.positions[batch:] = 0  # free slots: their writes land at position 0 and are never read
        if not self._graphs:
            self._capture_all()
        graph, logits, routing = self._graphs[(bucket, length)]
        graph.replay()
        self.last_routing = routing[:batch] if routing is not None else None
        return logits[:batch]

    def _capture_all(self) -> None:
        """Capture every (batch bucket, length bucket) graph at the first decode, largest first (they
        share one memory pool), so that no capture stalls a later step. Captures run the step on the
        current inputs; rows past the running batch compute on free slots, whose contents do not
        matter, and running rows rewrite the same key/value, so they are harmless."""
        start = time.perf_counter()
        for batch in reversed(self.batch_buckets):
            for length in reversed(self.length_buckets):
                self._graphs[(batch, length)] = self._capture(batch, length)
        logger.info("captured %d decode graphs in %.1f s", len(self._graphs), time.perf_counter() - start)

    def _capture(self, batch: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, kernel selection)
            self._step(batch, length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, routing = self._step(batch, length)
        self._pool = graph.pool()
        return graph, logits, routing

    def _add_norm(self, residual: torch.Tensor, delta: torch.Tensor, norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            return self._add_norm_fn(residual, delta, norm.weight, norm.variance_epsilon)
        hidden = residual + delta
        return hidden, norm(hidden)

    def _qkv(self, layer: int, attention: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fused = self.projections.attention[layer] if self.projections is not None else None
        if fused is not None:
            return fused(x)
        return attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)

    def _moe(self, layer: int, mlp: Any, x: torch.Tensor, mode: str,
             routing: list[torch.Tensor | None]) -> torch.Tensor:
        """A sparse MoE block over x [B, T, H] (moe.py), its router's ids [B, T, k] appended to `routing`; a shared
        expert (GLM-4.5) added to the routed experts' output, as `transformers` adds it (routed + shared)."""
        batch, width, size = x.shape
        flat = x.reshape(batch * width, size)
        weights, ids = route(mlp.gate, flat)
        routing.append(ids.view(batch, width, -1))
        out = experts_forward(mlp.experts, flat, weights, ids, mode)
        shared = getattr(mlp, "shared_experts", None)
        if shared is not None:  # before the all-reduce: one sum over the ranks for both partial outputs
            fused = self.projections.mlp[layer] if self.projections is not None else None
            out = out + shared_expert_forward(shared, flat, fused, self._silu_mul if self.fused and self._silu_mlp
                                              else None)
        if self.tp is not None:  # each rank's experts hold a slice of their intermediate dimension (tp_shard.py)
            self.tp.all_reduce(out)
        if shared is not None and shared.down_proj.bias is not None:
            out = out + shared.down_proj.bias
        return out.view(batch, width, size)

    def _mlp(self, layer: int, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        fused = self.projections.mlp[layer] if self.projections is not None else None
        if fused is not None:
            gate, up = fused(x)
        elif self.fused and self._silu_mlp:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        else:
            return mlp(x)
        if self.fused and self._silu_mlp:
            return mlp.down_proj(self._silu_mul(gate, up))
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _step(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode step's logits [B, V] and routed experts [B, L, k] (None for a dense model)."""
        model = self.model.model
        tokens, positions = self.tokens[:batch], self.positions[:batch]
        rows = torch.arange(batch, device=self.device)
        hidden = model.embed_tokens(tokens.unsqueeze(1))  # [B, 1, H]: the residual stream
        cos, sin = model.rotary_emb(hidden, positions.unsqueeze(1))
        # a row attends to its positions 0 .. p: an additive mask in the cache's dtype, made once per step (a
        # boolean one is turned into this by every layer's attention call, one more kernel per layer)
        visible = torch.arange(length, device=self.device).unsqueeze(0) <= positions.unsqueeze(1)
        mask = torch.where(visible, self._attend, self._masked)[:, None, None, :]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = self.keys[layer], self.values[layer]
            q = self._rotate_write(q, k, v, cos, sin, keys, values, rows, positions)  # q, k come unrotated
            # grouped-query decode as plain attention: the heads sharing a key/value head become that
            # head's query rows ([B, kv_heads, heads / kv_heads, D]), so no key/value is repeated
            q = q.reshape(batch, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
            out = F.scaled_dot_product_attention(q, keys[:batch, :, :length], values[:batch, :, :length],
                                                 attn_mask=mask, scale=self.scaling)
            return out.reshape(batch, 1, self.heads * self.head_dim)

        routing: list[torch.Tensor | None] = []
        x = self._layers(hidden, cos, sin, attend, rotate=False, moe_mode=self.moe_decode_mode, routing=routing)
        record = routing_record(routing, self.top_k)[:, 0] if any(self.moe) else None
        return self.model.lm_head(x)[:, 0], record

    def _layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Any,
                rotate: bool = True, moe_mode: str = "sorted",
                routing: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """The decoder layers and the final norm over `hidden` [B, T, H] (T = 1 in a decode step, the prompt
        width in a prefill): the normed last hidden states [B, T, H]. `attend(layer, q, k, v)` gets the rotated
        queries [B, heads, T, D] and keys, values [B, kv_heads, T, D], stores the keys/values where they belong
        and returns the attention output [B, T, heads * D]. With `rotate=False` it gets q and k unrotated and
        rotates them itself (the decode step's `rotate_write_kv`, fused or not). A MoE layer dispatches its experts
        by `moe_mode` and appends its router's ids [B, T, k] to `routing` (a layer without a router appends None)."""
        routing = [] if routing is None else routing
        batch, width = hidden.shape[:2]
        x = self.layers[0].input_layernorm(hidden)  # later norms come with their residual add
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.model.model.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms, strict=True)):
            attention = layer.self_attn
            q, k, v = self._qkv(i, attention, x)
            q = q.view(batch, width, self.heads, self.head_dim)
            k = k.view(batch, width, self.kv_heads, self.head_dim)
            v = v.view(batch, width, self.kv_heads, self.head_dim)
            if hasattr(attention, "q_norm"):
                q, k = attention.q_norm(q), attention.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, D]
            if rotate:
                q, k = self._rotate(q, k, cos, sin)
            out = attention.o_proj(attend(i, q, k, v.transpose(1, 2)))
            hidden, x = self._add_norm(hidden, out, layer.post_attention_layernorm)
            if self.moe[i]:
                mlp_out = self._moe(i, layer.mlp, x, moe_mode, routing)
            else:
                mlp_out = self._mlp(i, layer.mlp, x)
                routing.append(None)
            hidden, x = self._add_norm(hidden, mlp_out, next_norm)
        return x
