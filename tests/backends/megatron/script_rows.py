"""Run one of this folder's scripts in a fresh interpreter and read the JSON lines it prints.

The Megatron tests run their work as scripts (train_parity.py, value_parity.py, ...): Megatron's
parallel state is global to a process, so each check gets a process of its own, started from the
repository root with this interpreter.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def run_script(name: str, *args: Any, timeout: float) -> list[dict[str, Any]]:
    """The JSON rows (stdout lines starting with "{") of `python <this folder>/<name> args...`.

    A non-zero exit fails the calling test with the last 3000 characters of the script's stderr.
    """
    result = subprocess.run([sys.executable, str(Path(__file__).with_name(name)), *map(str, args)],
                            capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def rows_by_case(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`rows` keyed by their "case" field."""
    return {row["case"]: row for row in rows}
