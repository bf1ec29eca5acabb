"""Slow: the whole tiny pipeline (convert -> sft -> rejection_sampling -> rl -> evaluate -> export) through a real
Prefect API with the store on s3:// (a moto server on 127.0.0.1). Every artifact, checkpoint, manifest, report,
metric and Prefect result is in S3; checkpoints and HF directories are staged locally only as downloads of
committed artifacts or as outputs uploaded after their stage (slime/storage/staging.py). A second run reuses
every stage from the store."""

import json
import sys
import time
from pathlib import Path

import fsspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))  # s3_server

from s3_server import moto_s3_options  # noqa: E402

from flows.pipeline import pipeline  # noqa: E402
from slime.rl.metrics import read_metrics  # noqa: E402
from slime.storage import read_manifest  # noqa: E402
from slime.storage.manifest import verify_files  # noqa: E402
from tasks._cache import RESULTS_DIR  # noqa: E402

TINY_CPU = Path(__file__).resolve().parents[2] / "deployments" / "tiny-cpu.yaml"
BUCKET = "slime-pipeline"


@pytest.fixture(scope="module")
def s3_options():
    yield from moto_s3_options(BUCKET)


@pytest.mark.slow
def test_the_whole_pipeline_on_an_s3_store(prefect_api, tiny_kit, tmp_path, s3_options, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stage that wrote to a local path named like the URL would leave ./s3:
    store = f"s3://{BUCKET}/runs"
    params = {"config": str(TINY_CPU), "store": store, "run_id": "on-s3", "overrides": [
        "--storage-options", json.dumps(s3_options), "--staging-dir", str(tmp_path / "staging"),
        "--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]", "--sft-num-epoch", "1",
        "--prompt-data", str(tiny_kit.train), "--rs-prompt-data", f"{tiny_kit.train}@[0:4]", "--num-rollout", "2",
        "--rollout-batch-size", "2", "--global-batch-size", "8", "--micro-batch-size", "4", "--save-interval", "1",
        "--eval-prompt-data", "arithmetic", f"{tiny_kit.eval}@[0:4]"]}
    t0 = time.monotonic()
    results = pipeline(**params)
    seconds = time.monotonic() - t0
    print(f"the tiny pipeline on s3:// (moto): {seconds:.0f} s")
    assert {stage: r["status"] for stage, r in results.items()} == {
        "convert": "ran", "sft": "ran", "rejection_sampling": "ran", "rl": "ran", "evaluate": "ran", "export": "ran"}

    for stage, result in results.items():  # every artifact is in the store, whole
        for name, artifact in result["artifacts"].items():
            uri = artifact["uri"]
            assert uri.startswith(f"{store}/on-s3/"), (stage, name, uri)
            assert verify_files(uri, read_manifest(uri, s3_options), s3_options) == [], (stage, name)
    rl_checkpoint = results["rl"]["artifacts"]["checkpoint"]["uri"]
    assert rl_checkpoint == f"{store}/on-s3/rl/checkpoint/iter_0000001"
    assert results["export"]["metrics"]["source_checkpoint"] == rl_checkpoint
    evaluated = {r["metrics"]["checkpoint"] for r in [results["evaluate"], *results["evaluate"]["compared"]]}
    assert evaluated == {rl_checkpoint, results["sft"]["artifacts"]["checkpoint"]["uri"],
                         results["convert"]["artifacts"]["checkpoint"]["uri"]}
    check = results["export"]["answers_check"]["arithmetic"]  # the exported model, downloaded, in transformers
    assert check["prompts"] == 4 and check["same_answer"] == 4
    assert sorted(read_metrics(results["rl"]["metrics"]["metrics_uri"], s3_options)) == [0, 1]
    fs = fsspec.filesystem("s3", **s3_options)
    assert fs.ls(f"{BUCKET}/runs/on-s3/{RESULTS_DIR}")  # Prefect's stage results
    assert not list(tmp_path.glob("s3*"))

    again = pipeline(**params)  # everything reused from the store
    assert {r["status"] for r in again.values()} == {"cached"}
