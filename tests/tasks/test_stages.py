"""Stage tasks called through `task.fn` (no Prefect API): JSON results naming committed artifacts."""

import importlib
import json

import pytest

from slime.errors import ConfigError
from slime.storage import is_committed, manifest_hash, read_manifest
from tasks._stage import with_fields
from tasks.convert import convert
from tasks.export import export
from tasks.sft import sft


@pytest.fixture(scope="module")
def converted(kit_config, tiny_kit, tmp_path_factory):
    out = tmp_path_factory.mktemp("store") / "r" / "convert" / "checkpoint"
    return convert.fn(kit_config, "r", {"hf_checkpoint": str(tiny_kit.model_dir)}, str(out))


def test_convert_result_is_json_and_names_the_committed_checkpoint(converted):
    assert json.loads(json.dumps(converted)) == converted
    checkpoint = converted["artifacts"]["checkpoint"]
    assert checkpoint["uri"].endswith("/r/convert/checkpoint/iter_0000000")
    assert checkpoint["manifest_hash"] == manifest_hash(checkpoint["uri"])
    assert read_manifest(checkpoint["uri"]).metadata["stage"] == "convert"
    assert set(converted["seconds"]) == {"prepare output", "convert"} and converted["seconds"]["convert"] > 0


def test_export_task_commits_an_hf_model_and_names_a_bad_origin(kit_config, converted, tmp_path):
    load = converted["artifacts"]["checkpoint"]["uri"]
    with pytest.raises(ConfigError, match="nowhere"):
        export.fn(kit_config, "r", {"load": load, "origin_hf_dir": str(tmp_path / "nowhere")}, str(tmp_path / "hf"))
    result = export.fn(kit_config, "r", {"load": load}, str(tmp_path / "hf"))
    hf = result["artifacts"]["hf_model"]
    assert hf["uri"] == str(tmp_path / "hf") and is_committed(hf["uri"])
    assert result["metrics"]["source_checkpoint"] == load
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(hf["uri"]).config.vocab_size == 384


def test_sft_rerun_of_a_failed_attempt_resumes_from_its_checkpoint(kit_config, converted, tmp_path):
    save = tmp_path / "r" / "sft" / "checkpoint"
    config = with_fields(kit_config, sft__sft_num_epoch=2, sft__sft_save_interval=1)
    inputs = {"load": converted["artifacts"]["checkpoint"]["uri"], "sft_data": kit_config.sft.sft_data,
              "hf_checkpoint": kit_config.checkpoint.hf_checkpoint}
    first = sft.fn(config, "r", inputs, str(save))
    assert first["metrics"]["steps"] == 2 and first["metrics"]["resumed_from"] is None
    (save / "iter_0000002" / "manifest.json").unlink()  # as if the attempt died while committing step 2
    again = sft.fn(config, "r", inputs, str(save))
    assert again["metrics"]["resumed_from"] == str(save / "iter_0000001")
    assert again["metrics"]["last_loss"] == pytest.approx(first["metrics"]["last_loss"], rel=1e-5)


@pytest.mark.parametrize("stage", ["convert", "sft", "rejection_sampling", "rl", "evaluate", "export"])
def test_stage_tasks_persist_json_results_under_their_cache_policy(stage):
    """A pipeline re-run finds a stage's result only if the task persists it (as JSON) under its policy."""
    module = importlib.import_module(f"tasks.{stage}")
    stage_task = getattr(module, stage)
    assert stage_task.name == stage and stage_task.cache_policy is module.CACHE
    assert stage_task.persist_result is True and stage_task.result_serializer == "json"
    if stage == "evaluate":  # its own run name (the checkpoint it evaluates) and the GPU concurrency tag
        assert stage_task.task_run_name is module.eval_run_name and stage_task.tags == {module.GPU_TAG}
    else:
        assert stage_task.task_run_name == f"{stage}-{{run_id}}"


def test_with_fields_validates_and_leaves_the_original(kit_config):
    changed = with_fields(kit_config, checkpoint__save="/x", train__lr=0.5)
    assert (changed.checkpoint.save, changed.train.lr) == ("/x", 0.5)
    assert kit_config.checkpoint.save != "/x"
    with pytest.raises(ValueError):
        with_fields(kit_config, train__lr="fast")
