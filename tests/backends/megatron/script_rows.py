"""Run one of this folder's scripts in a fresh interpreter and read the JSON lines it prints.

The Megatron tests run their work as scripts (train_parity.py, value_parity.py, ...): Megatron's
parallel state is global to a process, so each check gets a process of its own, started from the
repository root with this interpreter. `run_scripts` runs a module's independent scripts two at a time.
"""

import json
import subprocess
import sys
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
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


def run_scripts(runs: dict[Hashable, tuple[Any, ...]], *, timeout: float) -> dict[Hashable, Future]:
    """`run_script(*args, timeout=timeout)` for each entry of `runs`, two at a time, once all have ended.

    Each script is a process of mostly one core, most of its time imports and set-up, so on two cores (CI's)
    two at a time take well under twice the time of one (test_train_actor_flags.py: 27 s one at a time, 19 s
    two at a time). Futures: `.result()` gives the rows, or raises the script's failure in the test that reads
    it, not in the others.
    """
    with ThreadPoolExecutor(max_workers=2) as pool:
        return {key: pool.submit(run_script, *args, timeout=timeout) for key, args in runs.items()}
