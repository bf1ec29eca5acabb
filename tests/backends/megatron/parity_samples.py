"""The batch the parity scripts train on (train_parity, value_parity, dp_parity: run as scripts, they
import this module from their own directory), and zero-padding of per-token rows for the hand-written side.

Six samples of random tokens with unequal prompt and response lengths, so micro-batches, padding and
per-sample vs per-token means all differ; one response token of each is left out of the loss.
"""

from collections.abc import Sequence

import torch

from slime.types import Sample

LENGTHS = [(4, 6), (9, 2), (3, 8), (6, 5), (2, 3), (7, 7)]  # (prompt, response) tokens of each sample


def make_samples(vocab: int, untrained: int = 0) -> list[Sample]:
    """The six samples (tokens drawn with seed 0, so every script and rank draws the same ones).

    Response token `untrained` (0: the first, e.g. a tool token; -1: the last) has loss mask 0;
    `metadata["advantage"]` is -1, 0, 1, -1, 0, 1 (the trainer's default advantages).
    """
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i, (prompt_len, response_len) in enumerate(LENGTHS):
        tokens = torch.randint(0, vocab, (prompt_len + response_len,), generator=generator).tolist()
        mask = [1] * response_len
        mask[untrained] = 0
        samples.append(Sample(index=i, tokens=tokens, response_length=response_len, loss_mask=mask,
                              metadata={"advantage": float(i % 3) - 1.0}))
    return samples


def padded(rows: Sequence[Sequence[float] | torch.Tensor], width: int) -> torch.Tensor:
    """Rows of per-token values as one float32 `[len(rows), width]` tensor, zeros after each row's end.
    Gradients flow from the result to rows that carry them."""
    return torch.stack([torch.cat([torch.as_tensor(row, dtype=torch.float32), torch.zeros(width - len(row))])
                        for row in rows])
