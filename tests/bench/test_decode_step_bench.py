"""bench/decode_step.py --prefill on the CPU (micro model, fp32): it runs, and both prefills agree."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_comparison_runs_and_the_two_prefills_agree():
    result = subprocess.run([sys.executable, "decode_step.py", "--random-qwen2", "micro", "--device", "cpu",
                             "--dtype", "float32", "--batches", "3", "--prompt-len", "24", "--prefill", "--rounds", "1",
                             "--prefill-steps", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT / "bench",
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("prefill"))
    assert line.startswith("prefill    3 x 24 tokens") and line.endswith("caches match (tolerance 1e-05): True"), line
    gap = float(re.search(r"max \|logit gap\| (\S+),", line).group(1))
    assert gap < 1e-5, line
