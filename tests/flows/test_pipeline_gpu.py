"""The whole pipeline on one GPU, shortened: deployments/gpu-small.yaml (the GPU kit, colocated, bf16,
built-in engine on CUDA, tensor sync) through Prefect and Ray with 6 RL steps (run on the GPU machine:
pytest -m gpu; about 8 minutes on an H100, docs/gpu.md says how to carry Ray and Prefect there).

It runs `bench/learning.py` once (the pipeline as a subprocess, `--json`) and checks that every stage
ran and that held-out accuracy rises from the untrained model to SFT, and that a few RL steps keep it
(the full 40 steps took it from 0.720 to 0.785 on an H100: docs/benchmarks.md).

Its store is `runs/gpu-pipeline-test` in the repository (ignored by git), kept between runs: a run stopped
from outside (a time limit) resumes from its completed stages when the test runs again, as `make run
RUN_ID=...` does; stages whose code or inputs changed run again (their cache keys). Remove the folder for a
run from scratch.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_pipeline_learns(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    out = tmp_path / "learning.json"
    store = ROOT / "runs" / "gpu-pipeline-test"
    cmd = [sys.executable, "bench/learning.py", "--config", "deployments/gpu-small.yaml", "--dataset",
           "multiplication", "--seeds", "1234", "--store", str(store), "--out", str(out),
           "--num-rollout", "6", "--eval-interval", "3", "--save-interval", "3", "--stream-logs"]
    # the pipeline's log is not captured, here or by bench/learning.py (--stream-logs): with -s it streams (a run
    # stopped by a time limit still shows how far it got), and without -s pytest shows it with a failure
    done = subprocess.run(cmd, cwd=ROOT, timeout=1500)
    assert done.returncode == 0, "the pipeline failed: its output is above"
    run = json.loads(out.read_text())["runs"][0]
    print(run)
    assert set(run["stage_seconds"]) == {"convert", "sft", "rejection_sampling", "rl", "evaluate", "export"}
    acc = run["accuracy"]
    assert acc["convert"] < 0.02 < 0.5 < acc["sft"], acc
    assert acc["rl"] >= acc["sft"] - 0.03, acc  # 6 steps need not add a measurable gain; 40 did
