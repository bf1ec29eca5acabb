"""Megatron trainer -> two built-in engines behind the router, in every sync mode (CPU, fp32).

One subprocess (Megatron's CPU compatibility layer is process-global) changes its weights and syncs
them three times, disk, tensor, distributed over gloo; each test checks one mode's record.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODES = ["disk", "tensor", "distributed"]


@pytest.fixture(scope="module")
def records(cluster, tiny_kit, tmp_path_factory):
    router, urls = cluster
    assert sorted(router.worker_urls()) == sorted(urls)
    work = tmp_path_factory.mktemp("megatron-sync")
    # Output to files, not pipes: torch's shared-memory manager (started by the tensor mode) inherits
    # the trainer's file descriptors and lives as long as the engines, so pipes would never close.
    with open(work / "out.txt", "w") as out, open(work / "err.txt", "w") as err:
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_sync.py")),
                               str(tiny_kit.model_dir), str(work), *router.worker_urls()],
                              stdout=out, stderr=err, timeout=600, cwd=ROOT)
    assert done.returncode == 0, (work / "err.txt").read_text()[-4000:]
    lines = (work / "out.txt").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    return {row["mode"]: row for row in rows}


@pytest.mark.parametrize("mode", MODES)
def test_sync_changes_outputs_and_version(records, mode):
    row = records[mode]
    step = MODES.index(mode) + 1
    assert row["result"]["mode"] == mode and row["result"]["weight_version"] == f"step-{step}"
    for (before_ids, before_version), (after_ids, after_version) in zip(row["before"], row["after"], strict=True):
        assert before_version != after_version == f"step-{step}"
        assert after_ids != before_ids, f"{mode}: greedy output unchanged after the sync"
    assert row["after"][0][0] == row["after"][1][0], "both engines must hold the same weights"


@pytest.mark.parametrize("mode", MODES)
def test_engine_log_probs_equal_trainer_log_probs(records, mode):
    row = records[mode]
    gaps = [abs(e - t) for lps in row["engines"].values()
            for engine, trainer in zip(lps, row["trainer"], strict=True)
            for e, t in zip(engine, trainer, strict=True)]
    assert len(gaps) == 2 * (8 + 5 + 12)
    print(f"{mode}: max |engine - trainer| log-prob gap {max(gaps):.2e}")
    assert max(gaps) < 1e-5, f"{mode}: engine and trainer log-probs differ by {max(gaps):.2e}"


@pytest.mark.parametrize("mode", MODES)
def test_update_applied_while_paused_then_continued(records, mode):
    row = records[mode]
    for update in row["updates"]:
        assert update["last"]["source"] == mode and update["last"]["success"]
        assert update["last"]["paused"] is True, "the update must run between pause and continue"
        assert update["paused"] is False, "generation must continue after the sync"


def test_sync_sizes_and_timing(records):
    disk, tensor, dist = (records[m]["result"] for m in MODES)
    assert disk["bytes"] == tensor["bytes"] == dist["bytes"] > 0
    assert disk["tensors"] == tensor["tensors"] == dist["tensors"]
    assert disk["buckets"] == 1 and tensor["buckets"] == dist["buckets"] > 1  # 256 KiB buckets
    for row in (disk, tensor, dist):
        seconds = row["seconds"]
        assert {"pause", "flush", "export", "transfer", "continue", "total"} <= set(seconds)
        assert seconds["total"] >= seconds["transfer"] > 0
        print(f"{row['mode']}: {row['bytes'] / 1e6:.2f} MB in {row['buckets']} bucket(s), "
              + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in seconds.items()))
    assert "connect" in dist["seconds"]
    groups = records["distributed"]
    assert all(u["groups"] == ["slime_weight_sync"] for u in groups["updates"])
    assert groups["groups_after_close"] == [[], []], "close() must destroy the engines' groups"
