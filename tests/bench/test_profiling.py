"""bench/profiling.py, which bench/train_step.py and bench/decode_step.py print their `--profile` tables with."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import each other so

import profiling  # noqa: E402


def test_the_table_names_the_step_s_costliest_operation(capsys) -> None:
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step() -> None:
        for _ in range(5):
            a @ b
        torch.relu(a)

    profiling.print_profile(step, rows=3, title="toy step")
    out = capsys.readouterr().out
    head, table = out.split("\n", 1)
    assert head.startswith("toy step: ") and " ms of " in head
    assert int(head.rsplit(", ", 1)[1].split()[0]) >= 6  # five matmuls and a relu at least
    rows = [line.strip() for line in table.splitlines() if line.strip().startswith("aten::")]
    assert rows and rows[0].startswith(("aten::matmul", "aten::mm"))  # sorted by self time: the matmuls lead
    assert len(rows) <= 3
