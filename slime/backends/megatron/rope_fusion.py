"""megatron's rotary-embedding fusion (`apply_rope_fusion`) as a torch.compile'd function instead of Transformer
Engine's kernel.

Without TE, megatron applies rotary embeddings with its unfused `_apply_rotary_pos_emb_bshd`
(`megatron.core.models.common.embeddings.rope_utils`): per query and key of every layer, cos and sin of the
frequencies, `t * cos`, the half rotation `cat((-x2, x1))`, `* sin`, the sum, and a final `cat` with the
(usually empty) unrotated tail that copies the whole tensor again; as many elementwise kernels backward. The
profile of the 1.5B step (docs/benchmarks.md) has 42 ms of `cat` and most of 77 ms of `mul` here.

`rotary` is the same arithmetic as megatron's (mscale 1, no multi-latent attention: what megatron routes to a
fused kernel), split in two: `cos_sin`, the angles' cosine and sine cast to the input's dtype, and `rotate`, the
pointwise rotation by them. `fused_apply_rotary_pos_emb` computes `cos_sin` eagerly (megatron's kernels, so the
bf16 cos/sin are megatron's bit for bit, which Triton's `cos`/`sin` need not be) and runs `rotate` compiled by
torch.compile, which on CUDA with Triton makes one pointwise kernel forward and one backward. `install()` puts
it where megatron's `apply_rotary_pos_emb` looks for TE's (the module global `fused_apply_rotary_pos_emb`), so
`apply_rope_fusion` turns it on. On CUDA, for the halves layout of Qwen and Llama, `rope_kernel`'s hand-written
Triton kernel does the rotation instead (the same values, one kernel each way as well, but a fraction of the host
time a torch.compile'd call costs: the 0.5B step is bound by the host, docs/benchmarks.md). Packed (THD) sequences need TE's THD kernel, which this does not provide;
slime's batches are right-padded (the SDPA attention refuses packed sequences), so megatron never asks for it.

cos/sin are computed once per angle table and dtype (`cached_cos_sin`), not per call: megatron passes every layer's
query and key the same `freqs` tensor, and its `RotaryEmbedding` keeps that tensor across steps for a sequence
length (an lru_cache), so the per-call `cos`, `sin` and two casts (4 launches per query and per key, 8 per layer:
192 a forward pass of a 24-layer model; bench/op_census.py) become 4 per sequence length. The values are the same
tensors' values; `install(cache_cos_sin=False)` restores the per-call computation for an A/B. A CUDA graph
capture computes them inside the graph as before (a cached tensor freed later must not be read by a replay).

Numerics: eager, `rotary` computes megatron's values bit for bit (tested on CPU). Compiled, the products of the
bf16 input with the bf16 cos/sin are exact in fp32 and their sum is rounded to bf16 once, where megatron rounds
each product and the sum: the compiled result is within one bf16 rounding of the exact rotation of the same
bf16 operands, forward and backward, and can differ from megatron's by a rounding of the *products* where they
cancel: it is the more accurate of the two (tested against an fp64 rotation, on CPU and on CUDA).
"""

from __future__ import annotations

import weakref

import torch

from slime.backends.megatron import rope_kernel


def cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the fp32 angles `freqs`, cast to `dtype`, as megatron computes them."""
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`t` [seq, batch, heads, dim] rotated by `cos`/`sin` [seq, 1, 1, rot_dim]: the first rot_dim channels by
    pairs (halves, or adjacent channels when `interleaved`), the rest unchanged."""
    rot_dim = cos.shape[-1]
    x = t[..., :rot_dim]
    if interleaved:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    out = x * cos + rotated * sin
    if rot_dim == t.shape[-1]:
        return out  # megatron concatenates the empty tail too: a full copy
    return torch.cat((out, t[..., rot_dim:]), dim=-1)


def rotary(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of `t` [seq, batch, heads, dim] by `freqs` [seq, 1, 1, rot_dim] (fp32 angles), eager."""
    return rotate(t, *cos_sin(freqs, t.dtype), interleaved)


_compiled = torch.compile(rotate)
# id(freqs) -> (a weak reference to freqs, its version, {dtype: (cos, sin)})
_COS_SIN: dict[int, tuple[weakref.ref, int, dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]]] = {}


def cached_cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos_sin(freqs, dtype)`, computed once while the same `freqs` tensor lives unchanged (megatron hands every
    layer, and every step of one sequence length, the same one); outside a CUDA graph capture only."""
    if freqs.requires_grad or (freqs.is_cuda and torch.cuda.is_current_stream_capturing()):
        return cos_sin(freqs, dtype)
    entry = _COS_SIN.get(id(freqs))
    if entry is None or entry[0]() is not freqs or entry[1] != freqs._version:
        if len(_COS_SIN) >= 64:  # tables whose freqs are gone (megatron's lru_cache keeps 32)
            for key in [k for k, (ref, _, _) in _COS_SIN.items() if ref() is None]:
                del _COS_SIN[key]
        entry = _COS_SIN[id(freqs)] = (weakref.ref(freqs), freqs._version, {})
    tables = entry[2]
    if dtype not in tables:
        tables[dtype] = cos_sin(freqs, dtype)
    return tables[dtype]


def _fused_rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation by a fused kernel: rope_kernel's Triton kernel where it applies (CUDA, the halves layout), else
    the compiled `rotate`."""
    if rope_kernel.applies(t, cos, interleaved):
        return rope_kernel.rotary(t, cos, sin)
    return _compiled(t, cos, sin, interleaved)


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """TE's `fused_apply_rotary_pos_emb(t, freqs, interleaved=...)` signature, as megatron calls it."""
    return _fused_rotate(t, *cached_cos_sin(freqs, t.dtype), interleaved)


def fused_apply_rotary_pos_emb_uncached(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`fused_apply_rotary_pos_emb` with cos/sin computed at every call (the A/B of `install(cache_cos_sin=False)`)."""
    return _fused_rotate(t, *cos_sin(freqs, t.dtype), interleaved)


def compiled_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`fused_apply_rotary_pos_emb` with the compiled `rotate` even where the Triton kernel applies (the A/B of
    `install(kernel="compiled")`)."""
    return _compiled(t, *cached_cos_sin(freqs, t.dtype), interleaved)


def eager_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`fused_apply_rotary_pos_emb` run eagerly (cached cos/sin, the rotation as separate kernels): the A/B of
    `install(kernel="eager")`."""
    return rotate(t, *cached_cos_sin(freqs, t.dtype), interleaved)


KERNELS = ("triton", "compiled", "eager")


def install(cache_cos_sin: bool = True, kernel: str = "triton") -> bool:
    """Let megatron's `apply_rope_fusion` use `fused_apply_rotary_pos_emb` (idempotent); False where TE provides its
    kernel and that is used instead. For A/Bs: `cache_cos_sin` False, cos/sin at every call; `kernel` "compiled",
    the compiled rotation where the Triton kernel would run, "eager", the rotation as eager kernels (both with
    cos/sin cached)."""
    from megatron.core.models.common.embeddings import rope_utils

    if kernel not in KERNELS:
        raise ValueError(f"rope_fusion.install: kernel {kernel!r} is not one of {KERNELS}")
    ours = (fused_apply_rotary_pos_emb, fused_apply_rotary_pos_emb_uncached, compiled_apply_rotary_pos_emb,
            eager_apply_rotary_pos_emb)
    current = rope_utils.fused_apply_rotary_pos_emb
    if current is not None and current not in ours:
        return False
    if kernel == "triton":
        chosen = fused_apply_rotary_pos_emb if cache_cos_sin else fused_apply_rotary_pos_emb_uncached
    else:
        chosen = compiled_apply_rotary_pos_emb if kernel == "compiled" else eager_apply_rotary_pos_emb
    rope_utils.fused_apply_rotary_pos_emb = chosen
    return True
