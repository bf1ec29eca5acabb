"""The `slime` console script, run as a user runs it (subprocess, installed entry point)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slime.cli import main
from slime.storage import write_samples
from slime.types import Sample

ROOT = Path(__file__).resolve().parents[1]
SLIME = shutil.which("slime", path=str(Path(sys.executable).parent))


def run(*args, cwd=ROOT):
    return subprocess.run([SLIME, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_make_tiny_builds_a_loadable_kit(tmp_path):
    out = tmp_path / "kit"
    result = run("datasets", "make-tiny", str(out))
    assert result.returncode == 0, result.stderr
    assert f"tiny kit ready in {out}" in result.stdout
    manifest = json.loads((out / "kit.json").read_text())
    assert manifest["files"] and (out / "model" / "config.json").is_file()
    again = run("datasets", "make-tiny", str(out))  # idempotent
    assert again.returncode == 0 and json.loads((out / "kit.json").read_text()) == manifest


def test_config_show_prints_resolved_config_and_hashes():
    # 32 prompts x 4 samples = 128, a multiple of the file's global_batch_size (64)
    result = run("config", "show", "--config", "deployments/tiny-cpu.yaml", "--rollout-batch-size", "32",
                 "--sglang-mem-fraction-static", "0.5")
    assert result.returncode == 0, result.stderr
    assert "rollout_batch_size: 32" in result.stdout
    assert "mem_fraction_static: 0.5" in result.stdout
    assert "#   rollout: " in result.stdout


def test_config_errors_exit_2_with_location(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  rollout_batch_size: -3\n")
    result = run("config", "show", "--config", str(bad))
    assert result.returncode == 2
    assert f"{bad}:2: rollout.rollout_batch_size: Input should be greater than or equal to 1" in result.stderr


def test_shards_inspect_reports_ok_and_corruption(tmp_path):
    uri = tmp_path / "set"
    samples = [Sample(index=i, tokens=[1, 2, 3], response_length=1, loss_mask=[1]) for i in range(10)]
    write_samples(str(uri), samples, config_hash="cafe", metadata={"rollout_id": 0})
    ok = run("shards", "inspect", str(uri))
    assert ok.returncode == 0, ok.stderr
    assert "rows          10 in 1 files" in ok.stdout
    assert "tokens: list<item: int32>" in ok.stdout
    assert "checksums     ok (1 files verified)" in ok.stdout
    part = next(uri.glob("part-*"))
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    bad = run("shards", "inspect", str(uri))
    assert bad.returncode == 1
    assert "checksums     FAILED" in bad.stdout and part.name in bad.stdout
    missing = run("shards", "inspect", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "manifest.json is missing" in missing.stderr


def test_config_reference_matches_docs(capsys):
    assert main(["config", "reference"]) == 0
    generated = capsys.readouterr().out
    assert (ROOT / "docs" / "configuration.md").read_text() == generated, (
        "docs/configuration.md is stale: run `slime config reference > docs/configuration.md`"
    )


def test_pipeline_command_runs_the_prefect_flow():
    # `slime pipeline` hands over to `python -m flows.pipeline` (same flags); its help proves the handover
    result = run("pipeline", "--help")
    assert result.returncode == 0, result.stderr
    assert "flows.pipeline" in result.stdout and "--run-id" in result.stdout and "--config" in result.stdout


@pytest.mark.parametrize("stage", ["convert", "sft", "export", "rejection-sample", "evaluate", "rl"])
def test_built_stages_are_registered(stage):
    result = run(stage, "--help")
    assert result.returncode == 0 and "--config" in result.stdout
