"""bench/profiling.py, which bench/train_step.py and bench/decode_step.py print their `--profile` tables with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
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


def test_interleaved_ab_alternates_the_arms_and_leaves_the_change_on() -> None:
    now, state, toggled, synced = [0.0], {"on": None}, [], []

    def toggle(on: bool) -> None:
        state["on"] = on
        toggled.append(on)

    def step() -> None:  # the change saves 2 of 5 seconds; the machine slows down by 0.1 s a step
        now[0] += (3.0 if state["on"] else 5.0) + 0.1 * len(toggled)

    result = profiling.interleaved_ab(step, toggle, 3, clock=lambda: now[0], sync=lambda: synced.append(1))
    assert toggled == [True, False] * 3 + [True] and state["on"] is True
    assert result == pytest.approx({"on": 3.3, "off": 5.4})  # medians of 3.1/3.3/3.5 and 5.2/5.4/5.6
    assert len(synced) == 12  # before and after each timed step


def test_host_profile_names_the_function_that_cost_the_most_host_time(capsys) -> None:
    def busy_python() -> int:
        return sum(i * i for i in range(200_000))

    def step() -> None:
        busy_python()
        torch.relu(torch.ones(4))

    profiling.print_host_profile(step, rows=5, title="toy step")
    out = capsys.readouterr().out
    by_own, by_cumulative = out.split("by cumulative:")
    assert by_own.startswith("toy step (") and "by tottime:" in by_own
    listed = [line for line in by_own.splitlines() if "(" in line and ":" in line and "function calls" not in line]
    assert any("<genexpr>" in line or "busy_python" in line for line in listed[:3]), by_own  # the costliest first
    assert "busy_python" in by_cumulative
