"""Stage tasks called through `task.fn` (no Prefect API): JSON results naming committed artifacts."""

import json

import pytest

from slime.errors import ConfigError
from slime.storage import is_committed, manifest_hash, read_manifest
from tasks._stage import clear_output, with_fields
from tasks.convert import convert
from tasks.export import export


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
    assert set(converted["seconds"]) == {"clear output", "convert"} and converted["seconds"]["convert"] > 0


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


def test_clear_output_moves_previous_contents_aside(tmp_path):
    out = tmp_path / "sft" / "checkpoint"
    assert clear_output(str(out)) is None
    (out / "iter_0000001").mkdir(parents=True)
    (out / "iter_0000001" / "half-written").write_text("x")
    aside = clear_output(str(out))
    assert not out.exists() and aside.startswith(f"{out}.replaced-")
    assert (tmp_path / "sft" / aside.rsplit("/", 1)[-1] / "iter_0000001" / "half-written").read_text() == "x"


def test_with_fields_validates_and_leaves_the_original(kit_config):
    changed = with_fields(kit_config, checkpoint__save="/x", train__lr=0.5)
    assert (changed.checkpoint.save, changed.train.lr) == ("/x", 0.5)
    assert kit_config.checkpoint.save != "/x"
    with pytest.raises(ValueError):
        with_fields(kit_config, train__lr="fast")
