"""Fused core attention for megatron-core's local (non Transformer Engine) layer spec.

The local spec's `DotProductAttention` materialises the `[b, heads, s, s]` score matrix with
`baddbmm` + softmax + `bmm`: at sequence 4096 that is most of a step's memory traffic, and it gave
~13% MFU on an H100 (research/megatron.md). `SDPAttention` is a drop-in `core_attention` that calls
`torch.nn.functional.scaled_dot_product_attention`, which picks flash / memory-efficient / cuDNN
kernels on CUDA and a fused kernel on CPU, with grouped-query attention handled by the kernel.

It covers what the GPT models we bridge use (causal self-attention, GQA, optional attention
dropout, an explicit boolean mask); the variants it does not implement (layer-number query-key
scaling, sliding windows, softmax offsets, packed sequences, attention bias, context parallelism)
are refused at construction or call time instead of being computed differently.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from slime.errors import ConfigError


class SDPAttention(MegatronModule):
    """`core_attention` with `DotProductAttention`'s constructor and call signature, computed by SDPA.

    Shapes follow Megatron: query `[sq, b, heads, d]`, key/value `[sk, b, groups, d]` (heads of
    this tensor-parallel rank); the result is `[sq, b, heads * d]`.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        unsupported = {
            "context_parallel_size > 1": config.context_parallel_size > 1,
            "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
            "window_size (sliding-window attention)": config.window_size is not None,
            f"softmax_type {config.softmax_type!r}": config.softmax_type != "vanilla",
        }
        refused = [name for name, on in unsupported.items() if on]
        if refused:
            raise ConfigError(f"the SDPA core attention does not implement {', '.join(refused)}; "
                              "install Transformer Engine for these model features")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ConfigError("the SDPA core attention supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        sq, batch = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads|groups, s, d]
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # Megatron masks with True = hidden; SDPA attends where True
        causal = mask is None and mask_type == AttnMaskType.causal
        dropout = self.dropout if self.training else 0.0

        def attend() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                  scale=self.softmax_scale, enable_gqa=self.heads != self.groups)

        if dropout > 0.0:  # the same RNG stream as Megatron's attention dropout
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        return context.permute(2, 0, 1, 3).reshape(sq, batch, self.heads * self.head_dim)


def with_sdpa(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a local transformer-layer spec whose self-attention uses `SDPAttention`."""
    attention = layer_spec.submodules.self_attention
    if not dataclasses.is_dataclass(getattr(attention, "submodules", None)):
        return layer_spec
    attention = dataclasses.replace(attention,
                                    submodules=dataclasses.replace(attention.submodules, core_attention=SDPAttention))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules,
                                                                          self_attention=attention))
