"""optimizer.use_foreach_param_copy: megatron's fp32 main -> bf16 model parameter copy as one torch._foreach_copy_
instead of a copy_ per parameter, with the same bits."""

import torch
from script_rows import run_script

from slime.backends.megatron.optimizer import _foreach_copy_this_to_that


def test_foreach_copy_rounds_as_copy_does():
    g = torch.Generator().manual_seed(0)
    this = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g) * 1e3, torch.randn(1, generator=g)]
    that = [torch.empty_like(t, dtype=torch.bfloat16) for t in this]
    _foreach_copy_this_to_that(this, that)
    assert all(torch.equal(b, a.to(torch.bfloat16)) for a, b in zip(this, that, strict=True))
    _foreach_copy_this_to_that([], [])  # megatron calls it with empty groups too


def test_megatron_optimizer_copy_is_the_same_bits(tiny_kit):
    row = run_script("param_copy_parity.py", tiny_kit.model_dir, timeout=300)[0]
    assert row["leaves"] >= 1 and row["main_params"] > 0, row
    assert row["changed"] > 0, row  # the copy wrote new values (so there was something to compare)
    assert row["identical"], row
