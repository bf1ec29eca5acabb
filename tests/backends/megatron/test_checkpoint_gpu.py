"""Bit-exact resume on CUDA (pytest -m gpu): the one-rank resume of test_checkpoint_resume.py with the
model, optimizer and the CUDA generators on the GPU (fp32, deterministic kernels), with CUDA's default
fused AdamW, whose `step` tensors live on the GPU."""

import pytest
import torch
from multirank import run_ranks
from test_checkpoint_resume import SCRIPT, assert_bit_exact

pytestmark = pytest.mark.gpu


def test_one_rank_resume_is_bit_exact_on_cuda(tiny_kit, tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    run = run_ranks(SCRIPT, 1, ["run", str(tiny_kit.model_dir), str(tmp_path)], timeout=600, env=env)
    resume = run_ranks(SCRIPT, 1, ["resume", str(tiny_kit.model_dir), str(tmp_path)], timeout=600, env=env)
    assert_bit_exact(run, resume)
    assert all(len(row["draws"]) == 4 for row in run[0] + resume[0])  # the CUDA generator was drawn from too
    assert all(row["fused"] for row in run[0] + resume[0])  # CUDA's default: fused AdamW, steps on the GPU
