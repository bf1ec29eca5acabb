"""A slot KV cache and a graph-captured decode step for the built-in engine (Qwen2, Qwen3, Llama).

The generic path of the scheduler (a `transformers` forward over a left-padded `DynamicCache`) pays,
at every decode step, for concatenating the cache, a Python-level model forward (hundreds of kernel
launches) and re-padding whenever rows join or leave. On a GPU that is launch-bound: ~3k tokens/s.

Here every running request owns a *slot*: row `s` of a preallocated cache `[slots, kv_heads,
max_len, head_dim]` per layer, holding its tokens at positions `0 .. n-1`. Running requests occupy
slots `0 .. B-1` (when one finishes, the last running slot moves into the hole), so a decode step
works on the first B rows only. Prompts are still prefilled by the model's own forward (any length,
left-padded together); their keys/values are then copied into the slots.

The decode step is written against the modules of the `transformers` model (its projections, norms,
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

Each step also samples (`decode_sample`): the graph ends with `sampling.sample_rows` on its logits,
reading every row's temperature, top_p, top_k, uniform number and position from one static input
buffer that the scheduler stages in pinned host memory (`stage`) and that is copied to the device in
one transfer per step, and writing tokens and log-probs to static outputs: a step is one copy in,
one replay and one small copy out, with no host synchronisation. Which passes the sampler runs is
fixed per graph: the default graphs cover temperature (greedy rows included) without truncation;
the first step with a row asking for top-k or top-p captures the (batch, length) graph that also
truncates (a full sort), once. Rows whose banned tokens must be masked (min_new_tokens) take
`decode` instead: logits out of the same graph, sampled eagerly.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from slime.engines.builtin.sampling import sample, sample_rows

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# The per-row inputs of a step, one float64 row each of the staged buffer (exact for every value: the
# float32 parameters, top_k and positions as integers, the float64 uniform), and their values for
# rows past the running batch (free slots: position 0, never read).
INPUT_ROWS = ("temperature", "top_p", "top_k", "uniform", "position")
_NEUTRAL = (1.0, 1.0, -1.0, 0.5, 0.0)


def slot_support(model: Any) -> str | None:
    """None when `model` can use the slot decoder, else why not."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (slot decoding covers {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return "sliding-window attention"
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


class _NoTruncatingGraph(Exception):
    """The top-k/top-p sampler could not be captured: the step samples eagerly."""


def _buckets(limit: int, start: int) -> list[int]:
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


class SlotDecoder:
    """The slot cache of one model and its decode step (graph-captured on CUDA)."""

    def __init__(self, model: Any, *, slots: int, max_len: int, device: torch.device, cuda_graphs: bool,
                 fuse: bool = True, graph_sampler: bool = True) -> None:
        reason = slot_support(model)
        if reason is not None:
            raise ValueError(f"slot decoding does not support {reason}")
        self.model = model
        self.slots = slots
        self.max_len = max_len
        self.device = device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        config = model.config
        self.layers = model.model.layers
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scaling = attention.scaling
        self._rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        self.fused = fuse and self.cuda_graphs
        self._silu_mlp = getattr(config, "hidden_act", None) == "silu"
        if self.fused:  # compiled at the first decode, before any capture (see the module docstring)
            self._add_norm_fn = torch.compile(add_rms_norm, dynamic=True)
            self._rotate = torch.compile(self._rotate, dynamic=True)
            self._silu_mul = torch.compile(silu_mul, dynamic=True)
        dtype = next(model.parameters()).dtype
        shape = (slots, self.kv_heads, max_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # the token each row feeds
        # per row: INPUT_ROWS (sampling parameters, uniform, the position the token goes to in its slot)
        self._neutral = torch.tensor(_NEUTRAL, dtype=torch.float64).unsqueeze(1).expand(-1, slots).contiguous()
        self.inputs = self._neutral.to(device, copy=True)
        pin = self.cuda_graphs  # pinned: the copy in does not wait for the device
        self._staging = [self._neutral.clone().pin_memory() if pin else self._neutral.clone() for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        # False: graphs decode only and `decode_sample` samples eagerly (--disable-graph-sampler)
        self.graph_sampler = graph_sampler
        self.truncate_in_graph = True  # False once capturing the truncating sampler failed (then eager)
        self.batch_buckets = _buckets(slots, 8) if self.cuda_graphs else []
        self.length_buckets = _buckets(max_len, 128)
        # (batch bucket, length bucket, truncating sampler) -> graph and its outputs (logits, tokens, packed)
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
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
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]

    # ------------------------------------------------------------------ decode

    def stage(self) -> torch.Tensor:
        """The host buffer [len(INPUT_ROWS), slots] (float64) for the next step's inputs, set to the
        neutral values: fill the running rows' columns, then pass it to `decode` / `decode_sample`.
        Two buffers alternate (pinned on CUDA, so the copy does not wait for the device), and one is
        handed out again only once its last copy has run: the host may stage a step while the one
        before it still waits on the device."""
        self._turn ^= 1
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()
        host = self._staging[self._turn]
        host.copy_(self._neutral)
        return host

    def decode(self, tokens: torch.Tensor, host: torch.Tensor, batch: int) -> torch.Tensor:
        """Logits [B, V] (float32) for feeding `tokens[i]` to slot i (i < B) at the position staged in
        `host` (from `stage`). On CUDA the graph also samples (parameters from `host`); that is unused."""
        return self._launch(tokens, host, batch, truncate=False)[0][:batch].float()

    def decode_sample(self, tokens: torch.Tensor, host: torch.Tensor, batch: int,
                      truncate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode as `decode` and sample every row with the parameters and uniform staged in `host`:
        (tokens [B] int64, [B, 2] float64 of each token and its log-prob), on the device, not waited for.
        `truncate`: some row has top_k or top_p set (the sampler then runs those passes). The tokens are
        a copy: the graph's own outputs change at its next replay."""
        if not self.graph_sampler:
            return self._sample_eagerly(tokens, host, batch)
        try:
            _, sampled, packed = self._launch(tokens, host, batch, truncate)
        except _NoTruncatingGraph:
            return self._sample_eagerly(tokens, host, batch)
        return sampled[:batch].clone(), packed[:batch]

    def _sample_eagerly(self, tokens: torch.Tensor, host: torch.Tensor,
                        batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_sample` with `sample` run eagerly on the default graph's logits (the same draws)."""
        logits = self.decode(tokens, host, batch)
        params = host[:4, :batch].clone()  # not the staging buffer itself: it is refilled two steps on
        sampled, logprobs = sample(logits, params[0].float(), params[1].float(), params[2].long(), params[3])
        return sampled, torch.stack([sampled.double(), logprobs.double()], dim=1)

    def _launch(self, tokens: torch.Tensor, host: torch.Tensor, batch: int,
                truncate: bool) -> tuple[torch.Tensor, ...]:
        longest = int(host[INPUT_ROWS.index("position"), :batch].max())
        length = next(b for b in self.length_buckets if b > longest)
        self.tokens[:batch] = tokens  # rows past B keep stale ids: valid tokens, computed on free slots
        self.inputs.copy_(host, non_blocking=True)
        if not self.cuda_graphs:
            return self._decode_and_sample(batch, length, truncate)
        copied = torch.cuda.Event()
        copied.record()
        self._copied[self._turn] = copied
        bucket = next(b for b in self.batch_buckets if b >= batch)
        if not self._graphs:
            self._capture_all()
        key = (bucket, length, truncate)
        if key not in self._graphs:  # the truncating sampler, first asked for at this (batch, length)
            if not self.truncate_in_graph:
                raise _NoTruncatingGraph
            start = time.perf_counter()
            try:
                self._graphs[key] = self._capture(*key)
            except RuntimeError as exc:  # guard: such steps then sample eagerly, the engine keeps serving
                logger.exception("capturing the top-k/top-p sampler failed; those steps sample eagerly")
                self.truncate_in_graph = False
                raise _NoTruncatingGraph from exc
            logger.info("captured the top-k/top-p decode graph %s in %.2f s", key[:2], time.perf_counter() - start)
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs

    def _decode_and_sample(self, batch: int, length: int, truncate: bool) -> tuple[torch.Tensor, ...]:
        """The captured step: decode, then sample with the staged inputs; (logits [B, V] in the model's
        dtype, tokens [B], [B, 2] float64 tokens and log-probs)."""
        logits = self._step(batch, length)
        if not self.graph_sampler:
            return (logits,)
        temperature, top_p, top_k, uniform, _ = self.inputs[:, :batch]
        tokens, logprobs = sample_rows(logits, temperature.float(), top_p.float(), top_k.long(), uniform,
                                       top_k=logits.shape[1] if truncate else 0, top_p=truncate)
        return logits, tokens, torch.stack([tokens.double(), logprobs.double()], dim=1)

    def _capture_all(self) -> None:
        """Capture every (batch bucket, length bucket) graph of the default sampler at the first decode,
        largest first (they share one memory pool), so that no capture stalls a later step. Captures
        run the step on the current inputs; rows past the running batch compute on free slots, whose
        contents do not matter, and running rows rewrite the same key/value, so they are harmless."""
        start = time.perf_counter()
        for batch in reversed(self.batch_buckets):
            for length in reversed(self.length_buckets):
                self._graphs[(batch, length, False)] = self._capture(batch, length, False)
        logger.info("captured %d decode graphs in %.1f s", len(self._graphs), time.perf_counter() - start)

    def _capture(self, batch: int, length: int, truncate: bool) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, kernel selection)
            self._decode_and_sample(batch, length, truncate)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._decode_and_sample(batch, length, truncate)
        self._pool = graph.pool()
        return graph, outputs

    def _add_norm(self, residual: torch.Tensor, delta: torch.Tensor, norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            return self._add_norm_fn(residual, delta, norm.weight, norm.variance_epsilon)
        hidden = residual + delta
        return hidden, norm(hidden)

    def _mlp(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        if self.fused and self._silu_mlp:
            return mlp.down_proj(self._silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        return mlp(x)

    def _step(self, batch: int, length: int) -> torch.Tensor:
        model = self.model.model
        tokens, positions = self.tokens[:batch], self.inputs[INPUT_ROWS.index("position"), :batch].long()
        rows = torch.arange(batch, device=self.device)
        hidden = model.embed_tokens(tokens.unsqueeze(1))  # [B, 1, H]: the residual stream
        cos, sin = model.rotary_emb(hidden, positions.unsqueeze(1))
        # a row attends to its positions 0 .. p (True = attend)
        mask = (torch.arange(length, device=self.device).unsqueeze(0) <= positions.unsqueeze(1))[:, None, None, :]
        x = self.layers[0].input_layernorm(hidden)  # later norms come with their residual add
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [model.norm]
        for layer, keys, values, next_norm in zip(self.layers, self.keys, self.values, norms, strict=True):
            attention = layer.self_attn
            q = attention.q_proj(x).view(batch, 1, self.heads, self.head_dim)
            k = attention.k_proj(x).view(batch, 1, self.kv_heads, self.head_dim)
            v = attention.v_proj(x).view(batch, 1, self.kv_heads, self.head_dim)
            if hasattr(attention, "q_norm"):
                q, k = attention.q_norm(q), attention.k_norm(k)
            q, k = self._rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, heads, 1, D]
            keys[rows, :, positions] = k[:, :, 0]
            values[rows, :, positions] = v[:, 0]
            # grouped-query decode as plain attention: the heads sharing a key/value head become that
            # head's query rows ([B, kv_heads, heads / kv_heads, D]), so no key/value is repeated
            q = q.reshape(batch, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
            out = F.scaled_dot_product_attention(q, keys[:batch, :, :length], values[:batch, :, :length],
                                                 attn_mask=mask, scale=self.scaling)
            out = attention.o_proj(out.reshape(batch, 1, self.heads * self.head_dim))
            hidden, x = self._add_norm(hidden, out, layer.post_attention_layernorm)
            hidden, x = self._add_norm(hidden, self._mlp(layer.mlp, x), next_norm)
        return self.model.lm_head(x)[:, 0]
