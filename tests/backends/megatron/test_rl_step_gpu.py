"""RL pieces of the train step on CUDA in bf16, random Qwen2.5-0.5B-shaped model (pytest -m gpu):
compute_log_probs vs HF, policy steps with KL, entropy, TIS and dynamic batching, critic value steps."""

import json
import math

import pytest
import torch
from script_rows import rows_by_case, run_script

pytestmark = pytest.mark.gpu


def test_rl_train_step_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    rows = rows_by_case(run_script("rl_step_gpu.py", tmp_path, timeout=900))
    print(json.dumps(rows, indent=1))
    scored = rows["compute_log_probs"]
    # bf16: Megatron's local spec and HF round differently (measured on an H200: mean 0.008, max 0.035)
    assert scored["mean_gap"] < 0.03 and scored["max_gap"] < 0.25, scored
    steps = rows["policy steps"]["steps"]
    first = steps[0]
    # slime's CI invariants for a first step: no policy change yet, reference = policy
    assert first["ppo_kl"] == 0.0 and first["kl_loss"] < 1e-8, first
    assert first["train_rollout_logprob_abs_diff"] < 0.1, first
    assert all(math.isfinite(s[k]) for s in steps for k in ("loss", "grad_norm", "entropy_loss", "tis"))
    assert steps[-1]["kl_loss"] > 0 and steps[-1]["loss"] < first["loss"], steps  # the policy moved
    assert all(s["num_microbatches"] == 4 for s in steps)  # ~10k tokens packed under 4096 per micro-batch
    values = rows["value steps"]
    assert values["values_finite"] and values["losses"][-1] < values["losses"][0], values
