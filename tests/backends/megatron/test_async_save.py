"""--async-save (slime/backends/megatron/async_save.py) on the CPU kit: a save returns before its files are
written, training goes on, the checkpoint is committed once every rank's writers are done, and it resumes
bit-exactly (two data-parallel ranks, DistributedOptimizer, gloo); keep_checkpoints prunes the older one.
A SIGKILL while the background writer runs leaves the previous checkpoint the newest committed one, and the
same save done again commits."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multirank import ROOT, run_ranks

from slime.backends.megatron.checkpoint import iteration_dir, latest_checkpoint
from slime.storage.manifest import is_committed, read_manifest

SCRIPT = Path(__file__).with_name("async_save_rank.py")


def by_step(rows: list[dict], where: str = "after step") -> dict[int, dict]:
    return {row["step"]: row for row in rows if row.get("where") == where}


def test_async_save_on_two_ranks_commits_after_the_writes_and_resumes_bit_exactly(tiny_kit, tmp_path):
    run = run_ranks(SCRIPT, 2, ["run", str(tiny_kit.model_dir), str(tmp_path), "--distributed", "dp_reshardable"],
                    timeout=600)
    full = tmp_path / "full"
    for rows in run:
        scheduled = [row for row in rows if "scheduled" in row]
        assert [row["scheduled"] for row in scheduled] == [2, 3]
        assert not any(row["committed_at_return"] for row in scheduled)  # the writers were still at it
        closed = next(row for row in rows if row.get("closed"))
        assert closed["left"] == ["iter_0000003"]  # keep_checkpoints 1: iteration 2 pruned once 3 committed
    assert run[0][-1]["committed"] == [str(iteration_dir(str(full), 2)), str(iteration_dir(str(full), 3))]
    manifest = read_manifest(str(full / "iter_0000003"))
    assert manifest.metadata["parallel"]["data_parallel_size"] == 2
    written = {entry.path for entry in manifest.files}
    # both ranks' optimizer shards, megatron's own metadata (written when finalized), the RNG of each rank
    assert {"optimizer/.metadata", "optimizer/metadata.json", "model/.metadata", "rng/rank_00000.json",
            "rng/rank_00001.json", "training_state.json"} <= written
    assert any(p.startswith("optimizer/__1_") for p in written) and any(p.startswith("optimizer/__0_") for p in written)

    resume = run_ranks(SCRIPT, 2, ["resume", str(tiny_kit.model_dir), str(tmp_path), "--distributed",
                                   "dp_reshardable"], timeout=600)
    for run_rows, resume_rows in zip(run, resume, strict=True):
        loaded = by_step(resume_rows, "after load")[3]
        assert loaded["extra_state"] == {"cursor": 3}
        expected, got = by_step(run_rows)[4], by_step(resume_rows)[4]
        for key in ("weights", "optimizer", "lr", "draws"):
            assert got[key] == expected[key], key
        # the state saved is step 3's, though step 4 trained while it was written
        assert by_step(run_rows)[3]["weights"] != expected["weights"]


def test_sigkill_during_the_background_write_leaves_the_previous_checkpoint(tiny_kit, tmp_path):
    full = tmp_path / "full"
    with open(tmp_path / "crash.out", "w+") as out, open(tmp_path / "crash.err", "w+") as err:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "crash", str(tiny_kit.model_dir), str(tmp_path)],
                                stdout=out, stderr=err, cwd=ROOT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while '"writing"' not in Path(out.name).read_text():
                assert proc.poll() is None, Path(err.name).read_text()[-3000:]
                assert time.monotonic() < deadline, "the crash rank never started its background write"
                time.sleep(0.2)
            assert (full / "iter_0000002").is_dir()  # the save began: its directory and JSON files exist
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the rank and the writer processes it forked
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not is_committed(str(full / "iter_0000002"))
    assert latest_checkpoint(str(full)) == str(full / "iter_0000001")

    redo = run_ranks(SCRIPT, 1, ["redo", str(tiny_kit.model_dir), str(tmp_path)], timeout=600)[0]
    assert by_step(redo, "after load")[1]["path"] == str(full / "iter_0000001")
    assert by_step(redo)[2]["committed"] == [str(full / "iter_0000002")]
    assert latest_checkpoint(str(full)) == str(full / "iter_0000002")
    assert json.loads((full / "iter_0000002" / "training_state.json").read_text())["iteration"] == 2


class StepwiseQueue:
    """Stands in for megatron's AsyncCallsQueue: each poll finalizes the next listed call indices."""

    def __init__(self, rounds: list[list[int]]) -> None:
        self.rounds, self.next_idx, self.closed = list(rounds), 0, False

    def schedule_async_request(self, request) -> int:
        self.next_idx += 1
        return self.next_idx - 1

    def maybe_finalize_async_calls(self, blocking: bool = False) -> list[int]:
        if blocking:
            rest = [i for r in self.rounds for i in r]
            self.rounds = []
            return rest
        return self.rounds.pop(0) if self.rounds else []

    def close(self) -> None:
        self.closed = True


def test_async_saver_commits_once_every_request_of_a_save_is_written(tmp_path):
    """A save's model and optimizer writes finishing at different polls still commit it (once, after both),
    the commit runs on a thread and its failure surfaces at the next poll, naming the checkpoint."""
    from slime.backends.megatron.async_save import AsyncSaveError, AsyncSaver

    saver = AsyncSaver()
    saver._queue = StepwiseQueue([[], [0], [], [1]])
    commits: list[str] = []
    saver.schedule("iter_1", ["model", "optimizer"], lambda: commits.append("iter_1"), background=True)
    assert saver.poll() == [] and saver.poll() == [] and saver.poll() == [] and commits == []  # optimizer writing
    saver.poll()  # both written: the commit thread starts
    saver.wait()
    assert commits == ["iter_1"] and saver.committed == ["iter_1"] and saver.in_flight == 0

    saver._queue = StepwiseQueue([[0, 1]])

    def fail() -> None:
        raise OSError("disk full")

    saver.schedule("iter_2", ["model", "optimizer"], fail, background=True)
    with pytest.raises(AsyncSaveError, match="iter_2.*previous checkpoint stays the newest.*disk full"):
        saver.wait()
    saver.close()
    assert saver._queue.closed
