"""Adapter-only weight sync (sync.lora_sync adapter, slime/sync/adapter.py) against merged sync, end to end:
a Megatron trainer with LoRA (CPU, fp32, tiny kit) after two train steps syncs merged weights into one
built-in engine and only its adapters into another; both engines must then score like the trainer."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from slime.engines.builtin.launcher import start_builtin_engine

ROOT = Path(__file__).resolve().parents[2]
REPEATS = 5


@pytest.fixture(scope="module")
def record(tiny_kit, tmp_path_factory):
    work = tmp_path_factory.mktemp("lora-sync")
    flags = ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "k_proj", "v_proj",
             "o_proj", "gate_proj", "up_proj", "down_proj"]
    started = [start_builtin_engine(str(tiny_kit.model_dir), log_path=work / f"engine{i}.log", dtype="float32",
                                    random_seed=i, extra_args=flags) for i in range(2)]
    try:
        with open(work / "out.txt", "w") as out, open(work / "err.txt", "w") as err:
            done = subprocess.run([sys.executable, str(Path(__file__).with_name("lora_adapter_sync.py")),
                                   str(tiny_kit.model_dir), str(work), *(url for _, url in started), str(REPEATS)],
                                  stdout=out, stderr=err, timeout=600, cwd=ROOT)
    finally:
        for process, _ in started:
            process.stop()
    assert done.returncode == 0, (work / "err.txt").read_text()[-4000:]
    line = next(line for line in (work / "out.txt").read_text().splitlines() if line.startswith("{"))
    return json.loads(line)


def gaps(a, b):
    return [abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True)]


def test_adapter_sync_scores_like_merged_sync_and_the_trainer(record):
    engines, trainer = record["engines"], record["trainer"]
    between = gaps(engines["adapter"], engines["merged"])
    assert len(between) == 8 + 5 + 12
    print(f"max |adapter - merged| engine log-prob gap {max(between):.2e}; adapter vs trainer "
          f"{max(gaps(engines['adapter'], trainer)):.2e}; merged vs trainer {max(gaps(engines['merged'], trainer)):.2e}")
    assert max(between) < 1e-5
    assert max(gaps(engines["adapter"], trainer)) < 1e-5
    assert max(gaps(engines["adapter_with_base"], trainer)) < 1e-5, "base pushed first, then the adapter"


def test_adapter_directory_is_published_and_the_previous_removed(record):
    last = f"lora_adapter_adapter-{REPEATS - 1}"
    assert record["listing"] == [last], "one published version, no temporary directory left behind"
    assert record["adapter_files"] == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert record["adapter_state"] == ["slime_policy"]
    assert record["with_base"]["seconds"].keys() >= {"base_export", "base_transfer", "transfer"}
    assert record["last_update"]["source"] == "disk", "the base went through /update_weights_from_disk"


def test_sync_bytes_and_seconds(record):
    results = record["results"]
    disk, tensor, adapter = (results[m] for m in ("disk", "tensor", "adapter"))
    assert all(r["mode"] == "adapter" for r in adapter)
    assert disk[0]["bytes"] == tensor[0]["bytes"]
    # rank 4 on every linear of the tiny model: the adapter is a few percent of the model
    assert 0 < adapter[0]["bytes"] < 0.1 * disk[0]["bytes"]
    with_base = record["with_base"]["bytes"]
    assert with_base == adapter[0]["bytes"] + disk[0]["bytes"], "the first sync with a base counts the base too"
    for name, rows in results.items():
        total = statistics.median(r["seconds"]["total"] for r in rows)
        transfer = statistics.median(r["seconds"]["transfer"] for r in rows)
        export = statistics.median(r["seconds"].get("export", 0.0) for r in rows)
        print(f"{name}: {rows[0]['bytes'] / 1e6:.3f} MB, {rows[0]['tensors']} tensors; median of {len(rows)}: "
              f"total {total * 1000:.1f} ms (export {export * 1000:.1f} ms, transfer {transfer * 1000:.1f} ms)")


@pytest.mark.slow  # ~55 s on 2 loaded cores (a Megatron TrainActor in a subprocess)
def test_train_actor_syncs_adapters_and_rollout_requests_name_them(tiny_kit, tmp_path):
    """`TrainActor.update_weights` under lora_sync adapter (its PEFT writer, its choice of no base push: the base is
    the engine's HF checkpoint), and `generate_turn` carrying lora_path once the rollout manager set it."""
    flags = ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "k_proj", "v_proj",
             "o_proj", "gate_proj", "up_proj", "down_proj"]
    process, url = start_builtin_engine(str(tiny_kit.model_dir), log_path=tmp_path / "engine.log", dtype="float32",
                                        extra_args=flags)
    try:
        with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
            done = subprocess.run([sys.executable, str(Path(__file__).with_name("train_actor_adapter_sync.py")),
                                   str(tiny_kit.model_dir), str(tmp_path), url],
                                  stdout=out, stderr=err, timeout=600, cwd=ROOT)
    finally:
        process.stop()
    assert done.returncode == 0, (tmp_path / "err.txt").read_text()[-4000:]
    line = next(line for line in (tmp_path / "out.txt").read_text().splitlines() if line.startswith("{"))
    rows = json.loads(line)["rows"]
    for version, row in enumerate(rows, start=1):
        assert row["metrics"]["sync/bytes"] > 0 and "sync/base_export_s" not in row["metrics"]
        assert max(gaps(row["engine"], row["trainer"])) < 1e-5, f"version {version}"
        assert row["turn_version"] == str(version), "generate_turn's request reached the synced engine"
        assert "requested LoRA adapters are not loaded: not_loaded" in row["refused"], row["refused"]
        assert row["listing"] == [f"lora_adapter_{version}"]
    assert rows[0]["engine"] != rows[1]["engine"], "the second sync replaced the adapter"
