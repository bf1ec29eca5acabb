"""megatron-core's local CUDA graphs (`megatron: {cuda_graph_impl: local}`) on CUDA (pytest -m gpu): train steps of
the tiny model with graphs against the same steps without (cuda_graph_parity.py), full training and LoRA."""

import pytest
import torch
from script_rows import run_script

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_graphed_steps_replay_each_layer_and_match_the_eager_losses(tiny_kit, mode):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    row = run_script("cuda_graph_parity.py", tiny_kit.model_dir, mode, timeout=300)[0]
    print(row)
    assert row["enabled"] and not row["plain_enabled"], row
    assert row["graph_layers"] == row["layers"] > 0, row  # every transformer layer has a graph manager
    # step 1 records eagerly and captures at its end; each later step replays a forward and a backward graph per
    # layer and micro-batch; the eager model never replays, nor do the forward-only log-probs (run eagerly)
    per_step = 2 * row["layers"] * row["micro_batches"]
    assert row["replays"] == [0] + [per_step] * (row["steps"] - 1), row
    assert row["plain_replays"] == [0] * row["steps"] and row["logprob_replays"] == 0, row
    assert row["first_loss_gap"] <= 1e-6, row  # the recording step computes what the eager step does
    assert row["graph_losses"][-1] < row["graph_losses"][0], row  # the replayed steps train
    # the same kernels, replayed: as close as two eager runs are (flash attention's backward is not bitwise
    # deterministic), with a floor for bf16 rounding of a different summation order
    # the first replayed step starts from the same weights and batch in every run: each parameter's gradient
    # (normalised by the step's total) within bf16 rounding of the eager one; a gradient the graphs miss, add
    # twice or read from stale memory would be ~1 off
    assert max(row["param_grad_gaps"].values()) < 0.25, row["param_grad_gaps"]
    assert row["loss_gap"] <= max(2 * row["rerun_loss_gap"], 1e-3), row
    assert row["norm_gap"] <= max(2 * row["rerun_norm_gap"], 1e-2), row
    assert row["logprob_gap"] <= max(2 * row["rerun_logprob_gap"], 2e-2), row
    assert row["refused"] and "has no CUDA graph" in row["refused"], row  # another shape: refused before the step
    assert row["plain_refused"] is None, row
