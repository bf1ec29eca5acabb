"""bench/op_census.py's counting: kernels and bytes of known ops, views not counted, phases and scopes of the HF
model's step (CPU, tiny shapes)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import each other so

import op_census  # noqa: E402


def test_known_ops_are_counted_with_their_bytes() -> None:
    a = torch.randn(8, 4, dtype=torch.bfloat16)
    b = torch.randn(4, 6, dtype=torch.bfloat16)
    census = op_census.Census()
    census.phase, census.scope = "fwd", "layer"
    with census:
        c = a @ b  # mm: reads 64 + 48 bytes, writes 96
        t = c.t()  # a view: no kernel
        t.contiguous()  # a copy: reads and writes 96
        c.float()  # a cast: reads 96, writes 192
        torch.cat([a, a])  # reads 2 x 64, writes 128
        c.add_(1.0)  # in place: reads and writes 96
        c.zero_()  # overwrites: writes 96
    totals = {cat: tuple(v) for (_, _, cat), v in census.totals.items()}
    assert totals == {"gemm": (1, 64 + 48 + 96), "copy": (1, 192), "cast": (1, 96 + 192), "cat": (1, 256),
                      "elem": (1, 192), "fill": (1, 96)}


def test_hf_step_is_split_into_phases_and_scopes() -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=50, tie_word_embeddings=True)
    census = op_census.hf_census(config, seq=16, dtype=torch.float32)
    rows = op_census.summarize(census, layers=3)
    for row in ("fwd/embed", "fwd/layer", "fwd/head", "fwd/loss", "bwd/loss", "bwd/head", "bwd/layer", "bwd/embed",
                "opt"):
        assert sum(v[0] for v in rows[row].values()) > 0, row
    # every layer runs the same ops: the per-layer mean is a whole number of kernels, with its 7 GEMMs forward
    # (q, k, v, o, gate, up, down) and an SDPA call each way
    assert rows["fwd/layer"]["gemm"][0] == 7 and rows["fwd/layer"]["attn"][0] == 1
    assert rows["bwd/layer"]["attn"][0] == 1 and rows["bwd/layer"]["gemm"][0] >= 7
    assert rows["fwd/head"]["gemm"][0] == 1  # the output layer; the loss has no GEMM
    assert "gemm" not in rows["fwd/loss"] and rows["opt"]["elem"][0] >= 1  # the fused AdamW kernel
