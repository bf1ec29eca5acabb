"""host_trims: megatron's linear layers without their per-call autocast context, tp_group deprecation warning and
one-rank identity region Functions train and score with the same bits (bf16 and fp32, full and LoRA, CPU), and the
trims are what runs.

The three cases are independent processes, run two at a time by one module fixture (script_rows.run_scripts)."""

import pytest
from script_rows import run_scripts

CASES = [("bf16", 0), ("fp32", 0), ("bf16", 4)]


@pytest.fixture(scope="module")
def runs():
    """Each case's rows, as a Future (a failed script fails the test that reads it, not the others)."""
    return run_scripts({case: ("host_trims_parity.py", *case) for case in CASES}, timeout=300)


@pytest.mark.parametrize(("dtype", "lora_rank"), CASES)
def test_host_trims_change_no_bits(runs, dtype, lora_rank):
    row = runs[dtype, lora_rank].result()[0]
    assert row["installed"] == [True, False], row
    # on: every linear backward (2 steps x 2 micro-batches x 2 layers x 4 linear layers, + the output layer when
    # it trains) skipped torch's autocast wrapper, the trainable ones' or, under LoRA, the frozen base ones';
    # off: none did
    lean = row["lean_frozen_calls"] if lora_rank else row["lean_calls"]
    assert lean[0] >= 2 * 2 * 2 * 4 and lean[1] == 0, row
    assert row["lean_calls" if lora_rank else "lean_frozen_calls"] == [0, 0], row
    # off: RowParallelLinear warned at each call; on: never
    assert row["tp_warnings"][0] == 0 and row["tp_warnings"][1] > 0, row
    # megatron's copy-to / reduce-from region Functions (identity at one rank): skipped on, 2 + 2 a layer off
    assert row["region_calls"][0] == 0 and row["region_calls"][1] >= 2 * 2 * 2 * 4, row
    assert row["losses"][0] == row["losses"][1] and row["grad_norms"][0] == row["grad_norms"][1], row
    assert row["params_changed"] > 0 and row["params_identical"] and row["logp_identical"], row
