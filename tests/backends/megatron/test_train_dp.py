"""Data parallel: two gloo ranks on CPU, each with its unequal share of the global batch, end two train
steps with the same weights and metrics as one rank with the whole batch (fp32).

Tolerance: 1e-6 absolute on every weight after two steps (measured: <= 1.2e-7). The ranks reduce in a
different order (per-rank sums, then the DP all-reduce), so bit-equality is not expected.
"""

from pathlib import Path

import pytest
from multirank import run_ranks
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

SCRIPT = Path(__file__).with_name("dp_parity.py")
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def runs(tiny_kit, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    single = run_ranks(SCRIPT, world_size=1, args=[str(tiny_kit.model_dir), str(out)], timeout=900)
    double = run_ranks(SCRIPT, world_size=2, args=[str(tiny_kit.model_dir), str(out)], timeout=900)
    initial = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir).state_dict()
    return out, single, double, initial


def test_advantage_whitening_over_dp(runs):
    _, single, double, _ = runs
    one = single[0][0]["advantages"]
    two = double[0][0]["advantages"] + double[1][0]["advantages"]  # ranks hold samples 0-3 and 4-5
    assert [len(a) for a in one] == [len(a) for a in two] == [6, 2, 8, 5, 3, 7]
    flat_one, flat_two = sum(one, []), sum(two, [])
    assert max(abs(a - b) for a, b in zip(flat_one, flat_two, strict=True)) < 1e-6
    trained = [a for row in one for a in row[1:]]  # token 0 of every sample is untrained (0)
    assert all(row[0] == 0.0 for row in one)
    assert abs(sum(trained) / len(trained)) < 1e-6  # whitened: mean 0 over all ranks' trained tokens


def test_two_ranks_equal_one_rank(runs):
    out, single, double, initial = runs
    single, double = [r[1:] for r in single], [r[1:] for r in double]  # r[0] is the whitening row
    assert len(single[0]) == 3 and len(double[0]) == len(double[1]) == 3
    for one, zero_of_two, one_of_two in zip(single[0], double[0], double[1], strict=True):
        slug = one["slug"]
        a = load_file(out / f"1-{slug}.safetensors")
        b = load_file(out / f"2-{slug}.safetensors")
        assert a.keys() == b.keys()
        gap = max((a[k] - b[k]).abs().max().item() for k in a)
        moved = max((a[k] - initial[k]).abs().max().item() for k in a)
        print(f"{slug}: weights moved {moved:.3g}, 1 vs 2 ranks {gap:.3g}")
        assert moved > 1e-3, (slug, moved)  # the steps did something
        assert gap < TOLERANCE, (slug, gap)
        # both ranks report the global metrics, equal to the single rank's
        for step, m in enumerate(one["metrics"]):
            for name in ("loss", "grad_norm"):
                assert zero_of_two["metrics"][step][name] == one_of_two["metrics"][step][name]
                assert m[name] == pytest.approx(zero_of_two["metrics"][step][name], abs=1e-5), (slug, name)
