"""The post-training pipeline on the tiny kit, through a real Prefect API: artifacts land in the
store layout, a failed stage is where a re-run resumes, completed stages come back Cached without
calling their stage function, and a corrupt artifact makes its stage (and what follows) run again.
A failure injected into rejection sampling resumes there (convert and sft Cached, their functions not
called again). The first tests leave optional stages out (`skip`) to stay fast; the slow one runs all six,
with a failure injected mid-RL, and ends with the RL metrics of an uninterrupted run of the same seed."""

import shutil
from pathlib import Path

import pytest
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client

import slime.backends.megatron.hf_export
import slime.stages.rejection_sampling
import tasks.convert
import tasks.export
import tasks.rejection_sampling
import tasks.sft
from flows.export import export_flow
from flows.pipeline import OPTIONAL, pipeline
from slime.rl.metrics import outcome, outcome_differences, read_metrics
from slime.storage import ArtifactStore, read_manifest
from slime.storage.manifest import verify_files
from tasks._report import artifact_key

TINY_CPU = Path(__file__).resolve().parents[2] / "deployments" / "tiny-cpu.yaml"


@pytest.fixture
def calls(monkeypatch):
    """How often each stage's slime function is called (the real function still runs)."""
    counts = {"convert": 0, "sft": 0, "rejection_sampling": 0, "export": 0}
    for stage, module, name in (("convert", tasks.convert, "run_convert"), ("sft", tasks.sft, "run_sft"),
                                ("rejection_sampling", tasks.rejection_sampling, "run_rejection_sampling"),
                                ("export", tasks.export, "run_export")):
        real = getattr(module, name)

        def spy(config, _stage=stage, _real=real):
            counts[_stage] += 1
            return _real(config)

        monkeypatch.setattr(module, name, spy)
    return counts


def statuses(results):
    return {stage: result["status"] for stage, result in results.items()}


def test_pipeline_resumes_at_the_failed_stage_and_reuses_completed_ones(prefect_api, tiny_kit, tmp_path, calls,
                                                                       inject_failure):
    store, origin = tmp_path / "store", tmp_path / "origin"
    shutil.copytree(tiny_kit.model_dir, origin)
    params = {"config": str(TINY_CPU), "store": str(store), "run_id": "t1", "skip": list(OPTIONAL),
              "overrides": ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]",
                            "--sft-num-epoch", "1", "--origin-hf-dir", str(origin)]}
    layout = ArtifactStore(str(store))

    # 1. export fails while writing the HF weights (a missing --origin-hf-dir now fails before any stage runs)
    failure = inject_failure(slime.backends.megatron.hf_export, "save_hf_weights")
    with pytest.raises(RuntimeError, match="injected failure in save_hf_weights"):
        pipeline(**params)
    assert calls == {"convert": 1, "sft": 1, "rejection_sampling": 0, "export": 1}
    assert layout.committed("t1", "convert") == [] and (store / "t1" / "convert" / "checkpoint").is_dir()
    sft_dir = store / "t1" / "sft" / "checkpoint" / "iter_0000001"
    assert read_manifest(str(sft_dir)).metadata["stage"] == "sft"

    # 2. fixed, same parameters: convert and sft are reused, export runs
    failure.armed = False
    state = pipeline(**params, return_state=True)
    results = state.result()
    assert statuses(results) == {"convert": "cached", "sft": "cached", "export": "ran"}
    assert calls == {"convert": 1, "sft": 1, "rejection_sampling": 0, "export": 2}
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
    assert calls == {"convert": 1, "sft": 1, "rejection_sampling": 0, "export": 2}

    # 4. the SFT checkpoint is corrupted on disk: sft runs again, and export after it; convert is reused
    weights = next(p for p in sorted(sft_dir.rglob("*")) if p.is_file() and p.name != "manifest.json"
                   and p.stat().st_size > 1000)
    weights.write_bytes(b"\0" * weights.stat().st_size)
    results = pipeline(**params)
    assert statuses(results) == {"convert": "cached", "sft": "ran", "export": "ran"}
    assert calls == {"convert": 1, "sft": 2, "rejection_sampling": 0, "export": 3}
    assert verify_files(str(sft_dir), read_manifest(str(sft_dir))) == []
    assert len(list(sft_dir.parent.glob("iter_0000001.replaced-*"))) == 1  # the corrupt one, kept aside


def test_a_failure_in_rejection_sampling_resumes_there_with_convert_and_sft_cached(prefect_api, tiny_kit, tmp_path,
                                                                                  calls, inject_failure):
    store = tmp_path / "store"
    params = {"config": str(TINY_CPU), "store": str(store), "run_id": "rs", "skip": ["rl", "evaluate"],
              "overrides": ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:32]",
                            "--sft-num-epoch", "1", "--prompt-data", str(tiny_kit.train),
                            "--rs-prompt-data", f"{tiny_kit.train}@[0:4]"]}
    # the stage fails mid-way: policy exported, engines up, then the sampling call raises
    failure = inject_failure(slime.stages.rejection_sampling, "generate_and_score")
    with pytest.raises(RuntimeError, match="injected failure in generate_and_score"):
        pipeline(**params)
    assert failure.failures == 1
    assert calls == {"convert": 1, "sft": 1, "rejection_sampling": 1, "export": 0}
    assert "accepted" not in ArtifactStore(str(store)).committed("rs", "rejection_sampling")

    failure.armed = False
    results = pipeline(**params)
    assert statuses(results) == {"convert": "cached", "sft": "cached", "rejection_sampling": "ran", "export": "ran"}
    assert calls == {"convert": 1, "sft": 1, "rejection_sampling": 2, "export": 1}  # convert, sft not called again
    assert failure.calls == 2 and failure.failures == 1
    accepted = results["rejection_sampling"]["artifacts"]["accepted"]["uri"]
    assert verify_files(accepted, read_manifest(accepted)) == []
    assert results["rejection_sampling"]["metrics"]["prompts"] == 4
    assert results["export"]["inputs"]["load"] == results["sft"]["artifacts"]["checkpoint"]["uri"]


@pytest.mark.slow
def test_full_pipeline_resumes_rl_after_a_failure_to_the_uninterrupted_metrics(prefect_api, tiny_kit, tmp_path, calls,
                                                                              failing_train):
    params = {"config": str(TINY_CPU), "store": str(tmp_path / "store"), "overrides": [
        "--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:64]", "--sft-num-epoch", "1",
        "--prompt-data", str(tiny_kit.train), "--rs-prompt-data", f"{tiny_kit.train}@[0:4]", "--num-rollout", "2",
        "--rollout-batch-size", "2", "--global-batch-size", "8", "--micro-batch-size", "4", "--save-interval", "1",
        "--eval-prompt-data", "arithmetic", f"{tiny_kit.eval}@[0:4]"]}
    # the reference: the same config and seed, uninterrupted (rejection sampling does not feed rl)
    failing_train.armed = False
    whole = pipeline(**params, run_id="whole", skip=["rejection_sampling", "evaluate"])
    assert whole["rl"]["metrics"]["start_rollout_id"] == 0
    assert calls == {"convert": 1, "sft": 1, "rejection_sampling": 0, "export": 1}

    failing_train.armed = True  # train-0001 fails, after iteration 0 was checkpointed
    with pytest.raises(RuntimeError, match="injected failure in train"):
        pipeline(**params, run_id="full")
    assert failing_train.failures == 1
    failing_train.armed = False
    results = pipeline(**params, run_id="full")
    assert statuses(results) == {"convert": "cached", "sft": "cached", "rejection_sampling": "cached",
                                 "rl": "ran", "evaluate": "ran", "export": "ran"}
    assert calls == {"convert": 2, "sft": 2, "rejection_sampling": 1, "export": 2}  # run "full": one each
    assert results["rl"]["metrics"]["start_rollout_id"] == 1 and results["rl"]["metrics"]["resumed"]
    rl_checkpoint = results["rl"]["artifacts"]["checkpoint"]["uri"]
    assert results["export"]["metrics"]["source_checkpoint"] == rl_checkpoint
    evaluated = {r["metrics"]["checkpoint"] for r in [results["evaluate"], *results["evaluate"]["compared"]]}
    assert evaluated == {rl_checkpoint, results["sft"]["artifacts"]["checkpoint"]["uri"],
                         results["convert"]["artifacts"]["checkpoint"]["uri"]}  # accuracy stage over stage
    check = results["export"]["answers_check"]["arithmetic"]  # the exported HF model, loaded with transformers
    assert check["prompts"] == 4 and check["same_answer"] == 4 and check["same_reward"] == 4
    rows = Artifact.get(artifact_key("full", "evaluate", "results")).data
    assert "arithmetic" in rows and "mean_reward" in rows

    # every RL step's results (reward, loss, KL, grad norm, eval) equal the uninterrupted run's
    records = read_metrics(results["rl"]["metrics"]["metrics_uri"])
    reference = read_metrics(whole["rl"]["metrics"]["metrics_uri"])
    assert sorted(records) == sorted(reference) == [0, 1]
    assert {"rl/reward_mean", "rl/grad_norm", "train/loss", "eval/arithmetic/mean_reward"} <= set(outcome(records[1]))
    for rollout_id in reference:
        assert outcome_differences(records[rollout_id], reference[rollout_id]) == [], rollout_id
