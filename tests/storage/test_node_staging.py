"""Checkpoints of a remote store from train ranks on several nodes, without Ray (slime/storage/node_staging.py):
one download per machine however many ranks stage the same artifact, a node's own staging directory for the
train fields, and a save committed in the store from every node's files with the manifest listing them all
(torch.distributed over gloo: three ranks, two "nodes" with their own directories)."""

import os
import threading
import time
from pathlib import Path

import fsspec
import pytest
import torch.multiprocessing as mp

from slime.config import Config
from slime.errors import CorruptArtifactError, NotCommittedError
from slime.storage import commit_directory, is_committed, read_manifest
from slime.storage.manifest import Manifest, verify_files
from slime.storage.node_staging import NODE_STAGING_ENV, commit_from_nodes, stage_on_node
from slime.storage.staging import download, local_path, upload


def committed_dir(path: Path, payload: bytes) -> str:
    (path / "model").mkdir(parents=True)
    (path / "model" / "shard.distcp").write_bytes(payload)
    (path / "training_state.json").write_text('{"iteration": 0}')
    commit_directory(str(path), "checkpoint")
    return str(path)


def test_ranks_of_one_machine_download_an_artifact_once(tmp_path, monkeypatch):
    source = committed_dir(tmp_path / "remote", b"w" * 4096)
    calls = []
    get_file = fsspec.implementations.local.LocalFileSystem.get_file

    def slow_get_file(self, *args, **kwargs):  # widens the window in which a second rank could start too
        calls.append(args[0])
        time.sleep(0.05)
        return get_file(self, *args, **kwargs)

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "get_file", slow_get_file)
    local = str(tmp_path / "node" / "ck")
    threads = [threading.Thread(target=download, args=(source, local)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 2  # the two files, once: the other three found the manifest in place
    assert is_committed(local) and Path(local, "model", "shard.distcp").read_bytes() == b"w" * 4096


def test_a_node_stages_the_train_fields_under_its_own_directory(tmp_path, monkeypatch):
    remote = "memory://node-staging/run/checkpoint"
    upload(committed_dir(tmp_path / "ck", b"v" * 100), f"{remote}/iter_0000003")
    monkeypatch.setenv(NODE_STAGING_ENV, str(tmp_path / "node-b"))
    driver_local = Config.model_validate({"run": {"staging_dir": str(tmp_path / "driver")},
                                          "checkpoint": {"save": str(tmp_path / "driver" / "x")}})
    config, staging = stage_on_node(driver_local, {"checkpoint.save": remote, "export.output_dir": "memory://e"})
    save = local_path(str(tmp_path / "node-b"), remote)
    assert config.checkpoint.save == save and staging.outputs == {save: remote}
    assert config.export.output_dir is None  # not a train field: the driver's business
    assert read_manifest(os.path.join(save, "iter_0000003")) == read_manifest(f"{remote}/iter_0000003")
    assert not (tmp_path / "driver").exists()


def _rank(rank: int, world: int, port: int, root: str, clash: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    node = "a" if rank < 2 else "b"  # ranks 0 and 1 share node a's directory, rank 2 is node b
    local = os.path.join(root, node, "iter_0000001")
    os.makedirs(os.path.join(local, "model"), exist_ok=True)
    Path(local, "model", f"__{rank}_0.distcp").write_bytes(bytes([rank]) * (100 + rank))
    if rank == 0:
        Path(local, "model", ".metadata").write_bytes(b"common")
    if clash and rank == 2:
        Path(local, "model", ".metadata").write_bytes(b"other")
    dist.barrier()
    try:
        manifest = commit_from_nodes(local, os.path.join(root, "store", "iter_0000001"), None,
                                     lambda files: Manifest(kind="checkpoint", files=files, metadata={"iteration": 1}))
        Path(root, f"result-{rank}").write_text(",".join(e.path for e in manifest.files))
    except CorruptArtifactError as exc:
        Path(root, f"result-{rank}").write_text(f"error: {exc}")
    dist.destroy_process_group()


def run_ranks(root: Path, clash: bool) -> list[str]:
    from slime.net import find_free_port

    mp.spawn(_rank, args=(3, find_free_port("127.0.0.1"), str(root), clash), nprocs=3, join=True)
    return [(root / f"result-{r}").read_text() for r in range(3)]


@pytest.mark.parametrize("clash", [False, True])
def test_a_save_from_two_nodes_is_committed_in_the_store_with_every_nodes_files(tmp_path, clash):
    results = run_ranks(tmp_path, clash)
    store = str(tmp_path / "store" / "iter_0000001")
    if clash:  # two nodes wrote one path with different bytes: refused on every rank, nothing committed
        assert all(r.startswith("error: ") and "two nodes wrote different contents" in r for r in results)
        assert not is_committed(store)
        return
    files = ["model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp", "model/__2_0.distcp"]
    assert results == [",".join(files)] * 3
    manifest = read_manifest(store)
    assert [e.path for e in manifest.files] == files and manifest.metadata == {"iteration": 1}
    assert verify_files(store, manifest) == []  # every file uploaded, sizes and hashes as listed
    for node in ("a", "b"):  # a node's share is never committed locally
        assert not is_committed(str(tmp_path / node / "iter_0000001"))


def test_ref_ckpt_step_stages_that_iteration_of_a_remote_ref_load(tmp_path, monkeypatch):
    """`checkpoint.ref_ckpt_step` names an older iteration of a remote `ref_load` root: the driver and each
    node stage that iteration (not the newest), and the train rank's reference resolves to its copy."""
    from slime.backends.megatron.checkpoint import reference_checkpoint
    from slime.backends.megatron.lora_weights import base_source
    from slime.storage.staging import staged

    remote = "memory://ref-step/sft/checkpoint"
    for step in (3, 7):
        upload(committed_dir(tmp_path / f"it{step}", str(step).encode() * 10), f"{remote}/iter_{step:07d}")
    config = Config.model_validate({"run": {"staging_dir": str(tmp_path / "driver")},
                                    "checkpoint": {"ref_load": remote, "ref_ckpt_step": 3}})
    with staged(config) as (local, staging):
        ref = reference_checkpoint(local.checkpoint)
        assert Path(ref, "model", "shard.distcp").read_bytes() == b"3" * 10
        assert staging.to_remote(ref) == f"{remote}/iter_0000003"
        assert base_source(local) == ref  # a LoRA stage's base: the same iteration
        monkeypatch.setenv(NODE_STAGING_ENV, str(tmp_path / "node-b"))  # a train rank on another node
        node, _ = stage_on_node(local, dict(staging.fields))
        node_ref = reference_checkpoint(node.checkpoint)
        assert node_ref.startswith(str(tmp_path / "node-b"))
        assert Path(node_ref, "model", "shard.distcp").read_bytes() == b"3" * 10
    newest = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"ref_ckpt_step": None})})
    with staged(newest) as (local, _):  # no step: the newest committed iteration, as before
        ref = reference_checkpoint(local.checkpoint)
        assert Path(ref, "model", "shard.distcp").read_bytes() == b"7" * 10
    fsspec.filesystem("memory").pipe_file("/ref-step/sft/checkpoint/iter_0000005/partial", b"?")  # no manifest
    missing = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"ref_ckpt_step": 5})})
    with pytest.raises(NotCommittedError, match=f"checkpoint.ref_ckpt_step 5: {remote}/iter_0000005 is not a "
                                                "committed checkpoint"), staged(missing):
        pass


def test_opd_teacher_load_is_staged_like_ref_load(tmp_path, monkeypatch):
    """A remote `checkpoint.opd_teacher_load` root with `opd_teacher_ckpt_step`: the driver and a train rank's node
    stage that iteration, and the rank's teacher resolves to its copy; an uncommitted step is refused by name."""
    from slime.backends.megatron.checkpoint import teacher_checkpoint
    from slime.storage.staging import staged

    remote = "memory://opd-step/rl/checkpoint"
    for step in (1, 2):
        upload(committed_dir(tmp_path / f"it{step}", str(step).encode() * 10), f"{remote}/iter_{step:07d}")
    config = Config.model_validate({"run": {"staging_dir": str(tmp_path / "driver")},
                                    "algorithm": {"use_opd": True, "opd_type": "megatron"},
                                    "checkpoint": {"opd_teacher_load": remote, "opd_teacher_ckpt_step": 1}})
    with staged(config) as (local, staging):
        path = teacher_checkpoint(local.checkpoint)
        assert Path(path, "model", "shard.distcp").read_bytes() == b"1" * 10
        assert staging.to_remote(path) == f"{remote}/iter_0000001"
        monkeypatch.setenv(NODE_STAGING_ENV, str(tmp_path / "node-b"))
        node, _ = stage_on_node(local, dict(staging.fields))
        node_path = teacher_checkpoint(node.checkpoint)
        assert node_path.startswith(str(tmp_path / "node-b"))
        assert Path(node_path, "model", "shard.distcp").read_bytes() == b"1" * 10
    missing = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(
        update={"opd_teacher_ckpt_step": 5})})
    with pytest.raises(NotCommittedError, match=f"checkpoint.opd_teacher_ckpt_step 5: {remote}/iter_0000005 is not a "
                                                "committed checkpoint"), staged(missing):
        pass
