"""The log-softmax over the vocabulary of one scoring chunk, forward and backward: `ResponseScores`' inner work,
run eagerly or torch.compile'd.

Eagerly, each step is its own kernel over the `[rows, n, V]` chunk: an fp32 copy of the bf16 logits, the max, the
subtraction, `exp`, the sum, the gather (forward), and again the fp32 copy, `exp`, the products, the one-hot term
and the bf16 gradient (backward), each reading and writing the chunk in fp32: about 100 bytes of memory traffic
per logit, which for a 152k vocabulary is 10-15% of a 1.5B train step's GPU time (the profile in
docs/benchmarks.md: `sub`, `exp`, `copy_`, `fill_` and the elementwise kernels). Compiled, inductor fuses the
forward into row reductions that read the bf16 logits and the backward into one pointwise kernel that reads them
and writes the bf16 gradient: under 10 bytes per logit, and no fp32 chunk in memory.

Both run the same arithmetic in the same order, so the values agree to fp32 rounding (the reductions may sum in
another order); the one-hot term is `where(token == target, g, 0)` added once, the value `scatter_add` would give.
`use_compiled` picks the compiled pair on CUDA with Triton (what inductor needs to make GPU kernels), unless the
config says otherwise (`train.compile_scores`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from slime.compiled import compiled as compiled_fn

ChunkForward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
ChunkBackward = Callable[..., torch.Tensor]


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """z: an fp32 copy of a logits chunk, divided by the temperature."""
    z = chunk.to(torch.float32, copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def chunk_forward(chunk: torch.Tensor, targets: torch.Tensor, temperature: float,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """From logits `[rows, n, V]` (any float dtype) and target ids `[rows, n]`: log p(target), log Z and, with
    `with_entropy`, E_p[z], where z = logits / T in fp32 and Z = sum exp(z)."""
    z = _scaled(chunk, temperature)
    log_z = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    mean_z = (torch.exp(z - log_z.unsqueeze(-1)) * z).sum(dim=-1) if with_entropy else None
    return logp, log_z, mean_z


def chunk_backward(chunk: torch.Tensor, targets: torch.Tensor, log_z: torch.Tensor, mean_z: torch.Tensor,
                   grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                   temperature: float) -> torch.Tensor:
    """The gradient of the chunk's logits, in their dtype: with p = exp(z - log Z),
    (g_logp * (onehot(target) - p) + g_H * p * (E_p[z] - z)) / T."""
    z = _scaled(chunk, temperature)
    p = torch.exp(z - log_z.unsqueeze(-1))
    g = torch.zeros_like(p)
    if grad_entropy is not None:  # dH/dz = p (E_p[z] - z)
        g = p * (mean_z.unsqueeze(-1) - z) * grad_entropy.unsqueeze(-1)
    if grad_logp is not None:  # dlogp/dz = onehot - p
        gl = grad_logp.unsqueeze(-1)
        hit = torch.arange(z.shape[-1], device=z.device) == targets.unsqueeze(-1)
        g = (g - p * gl) + torch.where(hit, gl, 0.0)
    if temperature != 1.0:
        g = g / temperature
    return g.to(chunk.dtype)


def kernels(compiled: bool) -> tuple[ChunkForward, ChunkBackward]:
    """The (forward, backward) pair: eager, or compiled (`compiled_kernels`)."""
    return compiled_kernels() if compiled else (chunk_forward, chunk_backward)


@functools.cache
def compiled_kernels() -> tuple[ChunkForward, ChunkBackward]:
    """The pair compiled once per process with dynamic shapes (the chunk's rows and positions change from batch
    to batch; they must not recompile), as the engine's `sampling.compiled_draw`."""
    off = "set train.compile_scores: false (--compile-scores false) for the eager kernels"
    return compiled_fn(chunk_forward, off, dynamic=True), compiled_fn(chunk_backward, off, dynamic=True)


def use_compiled(choice: bool | None, device: torch.device) -> bool:
    """`train.compile_scores` resolved for logits on `device`: unset, compiled where inductor makes GPU kernels
    (CUDA and Triton; on the CPU the eager kernels are what runs)."""
    if choice is not None:
        return choice
    from slime.backends.megatron.bridge import fused_activation_available

    return device.type == "cuda" and fused_activation_available()
