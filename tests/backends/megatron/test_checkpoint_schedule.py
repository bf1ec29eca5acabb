"""The LR schedule that checkpoints save and resume: megatron-core's OptimizerParamScheduler driven by the
typed `train:` fields, one scheduler step per optimizer step."""

import math

import pytest
import torch

from slime.backends.megatron.optimizer import build_scheduler
from slime.config import load_config
from slime.errors import ConfigError


def lrs(flags: list[str], total_steps: int | None, steps: int) -> list[float]:
    # the scheduler only touches `param_groups`, so a plain torch optimizer stands in for megatron's here
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, load_config(None, flags).train, total_steps)
    out = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        scheduler.step(1)
        out.append(optimizer.param_groups[0]["lr"])
    return out


def test_warmup_then_cosine_to_min_lr_over_the_stage():
    got = lrs(["--lr", "1.0", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--lr-warmup-init", "0.1",
               "--min-lr", "0.2"], total_steps=6, steps=7)
    # warmup 0.1 -> 1.0 over 2 steps, then 0.2 + 0.8 * (1 + cos(pi * (k - 2) / 4)) / 2 until step 6, then min_lr
    cosine = [0.2 + 0.8 * (1 + math.cos(math.pi * (k - 2) / 4)) / 2 for k in range(3, 7)]
    assert got == pytest.approx([0.1, 0.55, 1.0, *cosine, 0.2], abs=1e-12)


def test_constant_and_wsd():
    assert lrs(["--lr", "0.5"], total_steps=None, steps=3) == [0.5] * 4
    got = lrs(["--lr", "1.0", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2", "--lr-wsd-decay-style",
               "linear", "--lr-decay-iters", "4"], total_steps=None, steps=4)
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.0])


def test_decay_needs_a_length():
    with pytest.raises(ConfigError, match="needs lr_decay_iters"):
        lrs(["--lr-decay-style", "cosine"], total_steps=None, steps=0)
    with pytest.raises(ConfigError, match="lr_warmup_iters 4 must be below lr_decay_iters 4"):  # explicit: an error
        lrs(["--lr-decay-style", "linear", "--lr-warmup-iters", "4", "--lr-decay-iters", "4"], total_steps=None,
            steps=0)


def test_a_stage_shorter_than_its_warmup_warms_up_throughout():
    # a shortened run of a full config (20 warmup steps, a 4-step stage): warm up over 3 steps, then decay
    got = lrs(["--lr", "1.0", "--lr-decay-style", "linear", "--lr-warmup-iters", "20"], total_steps=4, steps=4)
    assert got == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 0.0])
