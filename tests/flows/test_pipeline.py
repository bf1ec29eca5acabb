"""The post-training pipeline on the tiny kit, through a real Prefect API: artifacts land in the
store layout, a failed stage is where a re-run resumes, completed stages come back Cached without
calling their stage function, and a corrupt artifact makes its stage (and what follows) run again.
The first test leaves the optional stages out (`skip`) to stay fast; the slow one runs all six."""

import shutil
from pathlib import Path

import pytest
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client

import tasks.convert
import tasks.export
import tasks.sft
from flows._report import artifact_key
from flows.export import export_flow
from flows.pipeline import OPTIONAL, pipeline
from slime.errors import ConfigError
from slime.storage import ArtifactStore, read_manifest
from slime.storage.manifest import verify_files

TINY_CPU = Path(__file__).resolve().parents[2] / "deployments" / "tiny-cpu.yaml"


@pytest.fixture
def calls(monkeypatch):
    """How often each stage's slime function is called (the real function still runs)."""
    counts = {"convert": 0, "sft": 0, "export": 0}
    for stage, module, name in (("convert", tasks.convert, "run_convert"), ("sft", tasks.sft, "run_sft"),
                                ("export", tasks.export, "run_export")):
        real = getattr(module, name)

        def spy(config, _stage=stage, _real=real):
            counts[_stage] += 1
            return _real(config)

        monkeypatch.setattr(module, name, spy)
    return counts


def statuses(results):
    return {stage: result["status"] for stage, result in results.items()}


def test_pipeline_resumes_at_the_failed_stage_and_reuses_completed_ones(prefect_api, tiny_kit, tmp_path, calls):
    store, origin = tmp_path / "store", tmp_path / "origin"
    params = {"config": str(TINY_CPU), "store": str(store), "run_id": "t1", "skip": list(OPTIONAL),
              "overrides": ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]",
                            "--sft-num-epoch", "1", "--origin-hf-dir", str(origin)]}
    layout = ArtifactStore(str(store))

    # 1. export fails: its origin HF directory is not there yet
    with pytest.raises(ConfigError, match="origin"):
        pipeline(**params)
    assert calls == {"convert": 1, "sft": 1, "export": 1}
    assert layout.committed("t1", "convert") == [] and (store / "t1" / "convert" / "checkpoint").is_dir()
    sft_dir = store / "t1" / "sft" / "checkpoint" / "iter_0000001"
    assert read_manifest(str(sft_dir)).metadata["stage"] == "sft"

    # 2. fixed, same parameters: convert and sft are reused, export runs
    shutil.copytree(tiny_kit.model_dir, origin)
    state = pipeline(**params, return_state=True)
    results = state.result()
    assert statuses(results) == {"convert": "cached", "sft": "cached", "export": "ran"}
    assert calls == {"convert": 1, "sft": 1, "export": 2}
    hf = results["export"]["artifacts"]["hf_model"]["uri"]
    assert hf == str(store / "t1" / "export" / "hf") and layout.committed("t1", "export") == ["hf"]
    for result in results.values():
        for artifact in result["artifacts"].values():
            assert verify_files(artifact["uri"], read_manifest(artifact["uri"])) == []
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).name == "post-training-t1"
    sft_report, export_report = (Artifact.get(artifact_key("t1", stage, "report")).data for stage in ("sft", "export"))
    assert "**reused**" in sft_report and str(sft_dir) in sft_report
    assert "**ran**" in export_report and hf in export_report

    # 3. nothing changed: every stage is reused, including export run alone (input found by layout)
    assert statuses(pipeline(**params)) == {"convert": "cached", "sft": "cached", "export": "cached"}
    alone = export_flow(params["config"], params["overrides"], params["store"], "t1")
    assert alone["status"] == "cached" and alone["inputs"]["load"] == str(sft_dir)
    assert calls == {"convert": 1, "sft": 1, "export": 2}

    # 4. the SFT checkpoint is corrupted on disk: sft runs again, and export after it; convert is reused
    weights = next(p for p in sorted(sft_dir.rglob("*")) if p.is_file() and p.name != "manifest.json"
                   and p.stat().st_size > 1000)
    weights.write_bytes(b"\0" * weights.stat().st_size)
    results = pipeline(**params)
    assert statuses(results) == {"convert": "cached", "sft": "ran", "export": "ran"}
    assert calls == {"convert": 1, "sft": 2, "export": 3}
    assert verify_files(str(sft_dir), read_manifest(str(sft_dir))) == []
    assert len(list(sft_dir.parent.glob("iter_0000001.replaced-*"))) == 1  # the corrupt one, kept aside


@pytest.mark.slow
def test_full_pipeline_resumes_rl_after_a_failure_and_keeps_earlier_stages(prefect_api, tiny_kit, tmp_path, calls,
                                                                        monkeypatch):
    from slime.rl import RLLoop

    store = tmp_path / "store"
    params = {"config": str(TINY_CPU), "store": str(store), "run_id": "full", "overrides": [
        "--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]", "--sft-num-epoch", "1",
        "--prompt-data", str(tiny_kit.train), "--rs-prompt-data", f"{tiny_kit.train}@[0:4]", "--num-rollout", "2", "--rollout-batch-size", "2",
        "--global-batch-size", "8", "--micro-batch-size", "4", "--save-interval", "1",
        "--eval-prompt-data", "arithmetic", f"{tiny_kit.eval}@[0:4]"]}
    real_train = RLLoop.train

    def failing_train(self, rollout_id, uri):
        if rollout_id == 1:
            raise RuntimeError("injected failure in train-0001")
        return real_train(self, rollout_id, uri)

    monkeypatch.setattr(RLLoop, "train", failing_train)
    with pytest.raises(RuntimeError, match="injected"):
        pipeline(**params)
    monkeypatch.setattr(RLLoop, "train", real_train)
    results = pipeline(**params)
    assert statuses(results) == {"convert": "cached", "sft": "cached", "rejection_sampling": "cached",
                                 "rl": "ran", "evaluate": "ran", "export": "ran"}
    assert calls == {"convert": 1, "sft": 1, "export": 1}
    assert results["rl"]["metrics"]["start_rollout_id"] == 1 and results["rl"]["metrics"]["resumed"]
    rl_checkpoint = results["rl"]["artifacts"]["checkpoint"]["uri"]
    assert results["export"]["metrics"]["source_checkpoint"] == rl_checkpoint
    evaluated = {r["metrics"]["checkpoint"] for r in [results["evaluate"], *results["evaluate"]["compared"]]}
    assert evaluated == {rl_checkpoint, results["sft"]["artifacts"]["checkpoint"]["uri"]}
    rows = Artifact.get(artifact_key("full", "evaluate", "results")).data
    assert "arithmetic" in rows and "mean_reward" in rows
