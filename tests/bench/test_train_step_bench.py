"""bench/train_step.py --loss grpo's pieces (reference model, old/reference log-prob recompute) on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_grpo_step_pieces(tiny_kit):
    result = subprocess.run([sys.executable, str(HERE / "train_step_grpo.py"), str(tiny_kit.model_dir)],
                            capture_output=True, text=True, timeout=300, cwd=HERE.parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][0])
    first, second = row["steps"]
    assert row["ref_trainable"] == 0  # frozen
    # the old log-probs are the policy's own; the reference starts as the policy, so the first KL is 0
    assert first["old_vs_direct"] < 1e-6 and first["old_vs_ref"] < 1e-6 and first["kl_loss"] < 1e-9, row
    # after one step the policy has moved away from the frozen reference
    assert second["old_vs_direct"] < 1e-6 and second["old_vs_ref"] > 1e-4 and second["kl_loss"] > 0, row
    assert first["grad_norm"] > 0, row
    # --reuse-log-probs: no old-policy pass, and the same step
    recomputed, reused = row["reuse"]["false"], row["reuse"]["true"]
    assert recomputed["has_old"] and not reused["has_old"], row
    for key in ("loss", "grad_norm", "pg_loss"):
        assert reused[key] == pytest.approx(recomputed[key], rel=1e-6, abs=1e-7), key
    assert row["packed_gap"] < 1e-5, row  # --log-probs-max-tokens: packed passes, the same log-probs


def test_megatron_options_are_read_as_the_config_reads_them():
    sys.path.insert(0, str(HERE.parents[1] / "bench"))
    from train_step import megatron_options

    assert megatron_options(["recompute_granularity=selective", "recompute_num_layers=2",
                             "bias_activation_fusion=false", "recompute_modules=[core_attn, mlp]"]) == {
        "recompute_granularity": "selective", "recompute_num_layers": 2, "bias_activation_fusion": False,
        "recompute_modules": ["core_attn", "mlp"]}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        megatron_options(["recompute_granularity"])
    with pytest.raises(SystemExit, match="cuda_graph_imp: not a model option"):
        megatron_options(["cuda_graph_imp=local"])  # a typo must not time the default
