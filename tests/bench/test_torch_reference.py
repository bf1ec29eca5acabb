"""bench/torch_reference.py's loop and bench/mfu.py's formula, on CPU with a tiny Qwen2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import each other so

import mfu  # noqa: E402
import torch_reference  # noqa: E402


def test_mfu_counts_forward_passes_as_a_third_of_a_train_pass() -> None:
    dense, attention = mfu.flops_per_token(params=10, layers=2, hidden=3, seq=5)
    assert (dense, attention) == (60, 6 * 2 * 5 * 3)
    assert mfu.flops_per_token(10, 2, 3, 5, forward_passes=2) == (100, 10 * 2 * 5 * 3)
    fields = mfu.mfu_fields(10**9, 28, 1536, 4096, 10_000, peak_tflops=100)
    assert fields["mfu"] == pytest.approx(6e9 * 1e4 / 1e14, abs=1e-4)
    assert fields["mfu_with_attention"] == pytest.approx((6e9 + 6 * 28 * 4096 * 1536) * 1e4 / 1e14, abs=1e-4)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_reference_step_learns_a_repeated_batch(checkpointing: bool) -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=50, tie_word_embeddings=True)
    torch.manual_seed(0)
    model, optimizer = torch_reference.build(config, torch.device("cpu"), checkpointing, dtype=torch.float32)
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    assert model.is_activation_checkpointing == checkpointing
    assert model.config._attn_implementation == "sdpa"
    tokens = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = [torch_reference.train_step(model, optimizer, tokens, micro_batch=2) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step


def test_micro_batches_accumulate_the_full_batch_gradient() -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=50)
    tokens = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    after = []
    for micro in (1, 4):
        torch.manual_seed(0)
        model, optimizer = torch_reference.build(config, torch.device("cpu"), False, dtype=torch.float32)
        torch_reference.train_step(model, optimizer, tokens, micro_batch=micro)
        after.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(after[0], after[1], atol=1e-6, rtol=1e-5)
