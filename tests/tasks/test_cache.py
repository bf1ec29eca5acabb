"""Stage cache keys: what changes them, what does not, and how a stale cached result is passed over."""

import shutil

import pytest
from prefect.filesystems import LocalFileSystem
from prefect.results import ResultStore
from prefect.serializers import JSONSerializer

from slime.errors import NotCommittedError
from slime.stages.definitions import SFT
from slime.stages.record import artifact_fingerprint, artifact_problems
from slime.storage import commit_directory, manifest_hash
from tasks._cache import (
    RESULTS_DIR,
    first_valid_key,
    result_storage,
    stage_cache_key,
    superseded_key,
)
from tasks._stage import with_fields


def committed_dir(path, content: bytes):
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(content)
    commit_directory(str(path), "checkpoint")
    return str(path)


def sft_key(config, inputs, output="/store/r/sft/checkpoint"):
    return stage_cache_key(config, SFT.config_fields, inputs, output, ("slime.stages.sft",), task_source="src",
                           left_out=SFT.left_out)


@pytest.fixture
def sft_inputs(tmp_path, tiny_kit):
    return {"load": committed_dir(tmp_path / "convert" / "iter_0000000", b"w1"),
            "sft_data": f"{tiny_kit.sft}@[0:64]", "hf_checkpoint": str(tiny_kit.model_dir)}


def test_key_follows_the_stage_config_section_not_unrelated_fields(kit_config, sft_inputs):
    key = sft_key(kit_config, sft_inputs)
    assert sft_key(kit_config, sft_inputs) == key  # deterministic
    assert sft_key(with_fields(kit_config, train__lr=1e-4), sft_inputs) != key
    assert sft_key(with_fields(kit_config, sft__sft_num_epoch=2), sft_inputs) != key
    # fields other stages read leave the SFT key alone
    assert sft_key(with_fields(kit_config, rollout__rollout_batch_size=32, eval__eval_interval=5), sft_inputs) == key
    assert sft_key(kit_config, sft_inputs, output="/store/other-run/sft/checkpoint") != key


def test_key_follows_input_manifest_content(kit_config, sft_inputs, tmp_path):
    key = sft_key(kit_config, sft_inputs)
    shutil.rmtree(sft_inputs["load"])
    committed_dir(tmp_path / "convert" / "iter_0000000", b"w2")  # same URI, new content
    assert sft_key(kit_config, sft_inputs) != key


def test_fingerprint_of_committed_and_plain_inputs(tmp_path):
    ckpt = committed_dir(tmp_path / "ckpt", b"abc")
    assert artifact_fingerprint(ckpt) == f"manifest:{manifest_hash(ckpt)}"
    data = tmp_path / "sft.jsonl"
    data.write_text('{"messages": []}\n')
    first = artifact_fingerprint(str(data))
    assert first.startswith("files:") and artifact_fingerprint(f"{data}@[0:8]") == first  # slice is in the URI
    data.write_text('{"messages": [1]}\n')
    assert artifact_fingerprint(str(data)) != first
    with pytest.raises(NotCommittedError, match="does not exist"):
        artifact_fingerprint(str(tmp_path / "missing"))


def test_artifact_problems_names_missing_and_corrupt_artifacts(tmp_path):
    ckpt = committed_dir(tmp_path / "ckpt", b"abc")
    result = {"artifacts": {"checkpoint": {"uri": ckpt, "manifest_hash": manifest_hash(ckpt)}}}
    assert artifact_problems(result) == []
    (tmp_path / "ckpt" / "weights.bin").write_bytes(b"abd")  # same size, other bytes
    assert any("sha256" in p for p in artifact_problems(result))
    (tmp_path / "ckpt" / "manifest.json").unlink()
    assert artifact_problems(result) == [f"checkpoint {ckpt}: manifest missing"]


def test_stale_cached_result_moves_the_key_on(tmp_path):
    store = ResultStore(result_storage=LocalFileSystem(basepath=str(tmp_path / "results")), serializer=JSONSerializer())
    ckpt = committed_dir(tmp_path / "ckpt", b"abc")
    result = {"artifacts": {"checkpoint": {"uri": ckpt, "manifest_hash": manifest_hash(ckpt)}}}
    assert first_valid_key(store, "k0") == "k0"  # nothing stored: the base key
    store.write(result, key="k0")
    assert first_valid_key(store, "k0") == "k0"  # intact: reuse
    shutil.rmtree(ckpt)
    fresh = ResultStore(result_storage=LocalFileSystem(basepath=str(tmp_path / "results")), serializer=JSONSerializer())
    k1 = first_valid_key(fresh, "k0")
    assert k1 == superseded_key("k0") != "k0"  # gone: the stage runs again under a successor key
    committed_dir(tmp_path / "ckpt", b"xyz")  # the re-run's artifact, stored under k1
    fresh.write({"artifacts": {"checkpoint": {"uri": ckpt, "manifest_hash": manifest_hash(ckpt)}}}, key=k1)
    assert first_valid_key(fresh, "k0") == k1  # stable afterwards: k0 stays stale, k1 is reused


def test_local_store_results_live_under_the_store(tmp_path):
    assert result_storage(str(tmp_path / "runs")) == tmp_path / "runs" / RESULTS_DIR
