"""The PPO critic: the policy's GPTModel with its vocabulary head swapped for a 1-output value head.

slime builds the critic the same way (`LinearForLastLayer(hidden, 1)` as `output_layer` on the
post-process stage, `slime/backends/megatron_utils/model_provider.py`): the transformer starts from the
same HF weights, the head starts fresh. The swap happens in mbridge's post-model-creation callback,
before megatron DDP allocates its gradient buffers. The HF weights load with the head detached for the
call (mbridge would map it onto `lm_head`, or for tied models onto the embedding a second time); the
head keeps its fresh initialisation. It is not tied to the input embedding, even where the LM head is.

The value of response token t is read where its log-prob is: at the hidden state of the token before
it (`logprobs.response_positions`), i.e. V(s_t) with s_t the context that produced token t.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from slime.backends.megatron.batching import micro_batches
from slime.backends.megatron.forward import forward_only, is_last_stage, share_from_last_stage
from slime.backends.megatron.logprobs import (
    PaddedBatch,
    forward_logits,
    pad_samples,
    response_positions,
    rows_to_host,
)
from slime.types import Sample


class ValueHead(torch.nn.Linear):
    """hidden -> 1 linear head, called the way GPTModel calls its output layer.

    Its weight is drawn from a generator of its own seed (torch.nn.Linear's default uniform bound), not
    from the process's random state, which differs between ranks and pipeline stages: every tensor-parallel
    rank holds the same head (it reads the full hidden states), and a critic built under any parallel
    layout starts from the same values."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__(hidden_size, 1, bias=False, dtype=dtype)
        self.sequence_parallel = False  # GPTModel reads it in inference mode
        bound = 1.0 / hidden_size**0.5
        with torch.no_grad():
            self.weight.copy_(torch.empty(1, hidden_size).uniform_(-bound, bound,
                                                                  generator=torch.Generator().manual_seed(seed)))

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return super().forward(hidden_states), None


def _attach_value_head(model: torch.nn.Module, *, post_process: bool, seed: int = 0, **_: Any) -> None:
    """mbridge post-model-creation callback: the last stage's LM head becomes a value head. No stage
    shares its embedding with the head any more: with pipeline stages, a first stage that still did would
    all-reduce its embedding gradient with a last stage that no longer takes part."""
    model.share_embeddings_and_output_weights = False
    if post_process:
        model.output_layer = ValueHead(model.config.hidden_size, model.config.params_dtype, seed)


def build_critic(bridge: Any, hf_dir: str | None = None, seed: int = 0) -> list[torch.nn.Module]:
    """DDP-wrapped critic chunks for `bridge`'s architecture, transformer loaded from `hf_dir` if given,
    value head drawn from `seed`. Pipeline stages and tensor parallelism are supported (the head sits on
    the last stage, whole on every tensor-parallel rank)."""
    dtype = bridge.dtype
    models = bridge.get_model(wrap_with_ddp=True, bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16,
                              use_cpu_initialization=not torch.cuda.is_available(),
                              ddp_config={"grad_reduce_in_fp32": True, "use_distributed_optimizer": False},
                              post_model_creation_callbacks=[partial(_attach_value_head, seed=seed)])
    if hf_dir is not None:
        with _heads_detached(models):
            bridge.load_weights(models, hf_dir)
    return models


@contextmanager
def _heads_detached(models: list[torch.nn.Module]) -> Iterator[None]:
    """The value heads taken off their models for the duration (parameters and buffers untouched)."""
    from megatron.core.utils import unwrap_model

    owners = [m for m in unwrap_model(models) if getattr(m, "output_layer", None) is not None]  # the last stage
    heads = [owner.output_layer for owner in owners]
    for owner in owners:
        owner.output_layer = None
    try:
        yield
    finally:
        for owner, head in zip(owners, heads, strict=True):
            owner.output_layer = head


def values_from_output(out: torch.Tensor, batch: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Critic values `[B, R_max]` float32 of the response tokens (0 where masked) and the mask, from the
    critic's output `[B, S, 1]` for `batch` (`logprobs.forward_logits`, on the last pipeline stage)."""
    positions, mask = response_positions(batch)
    values = out[..., 0].float().gather(1, positions)
    return torch.where(mask, values, 0.0), mask


def compute_values(models: list[torch.nn.Module], samples: list[Sample], *, micro_batch_size: int = 1,
                   use_dynamic_batch_size: bool = False, max_tokens_per_gpu: int | None = None,
                   pad_token_id: int = 0) -> list[torch.Tensor]:
    """Forward-only critic values per sample (1-D float32 CPU tensors of `response_length`), on every
    pipeline stage."""
    parts = micro_batches([len(s.tokens) for s in samples], micro_batch_size=micro_batch_size,
                          use_dynamic_batch_size=use_dynamic_batch_size, max_tokens_per_gpu=max_tokens_per_gpu)
    device = next(models[0].parameters()).device
    padded: dict[int, PaddedBatch] = {}  # id(indices) -> its batch, from `run` to `collect`

    def run(model: torch.nn.Module, indices: list[int]) -> torch.Tensor:
        batch = padded[id(indices)] = pad_samples([samples[i] for i in indices], pad_token_id, device)
        return forward_logits(model, batch)

    def collect(indices: list[int], out: torch.Tensor) -> tuple[list[int], PaddedBatch, torch.Tensor]:
        batch = padded.pop(id(indices))
        return indices, batch, values_from_output(out, batch)[0]

    values: list[torch.Tensor | None] = [None] * len(samples)
    for indices, batch, rows in forward_only(models, parts, run, collect):
        for row, i in enumerate(indices):
            values[i] = rows[row, : batch.host_response_lengths[row]]
    values = rows_to_host(values)
    return share_from_last_stage(values if is_last_stage() else None, [s.response_length for s in samples],
                                 device)
