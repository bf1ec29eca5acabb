"""Delta weight sync (slime/sync/delta.py): encodings, checksums, writing and applying a delta to an HF
checkpoint, and (slow) a delta sync into two built-in engines against a full disk sync of the same weights."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from slime.backends.megatron.hf_export import save_hf_weights
from slime.delta_codec import checksum, decode, encode, tensor_bytes
from slime.errors import CorruptArtifactError
from slime.sync.delta import INDEX, apply_delta, write_delta


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_encode_decode_round_trip(encoding):
    rng = np.random.default_rng(0)
    old = rng.integers(0, 256, 1000, dtype=np.uint8)
    new = old.copy()
    new[[3, 500, 999]] ^= 0x5A
    delta = encode(old, new, encoding)
    assert np.array_equal(decode(old, delta, encoding), new)
    if encoding == "overwrite":
        assert len(delta) == 3 * 9  # 3 positions (int64) + 3 values
    else:
        assert len(delta) == 1000 and np.count_nonzero(np.frombuffer(delta, np.uint8)) == 3


def test_checksums():
    assert checksum(b"abc", "adler32") == "024d0127"
    assert checksum(b"abc", "blake3") == "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
    assert len(checksum(b"abc", "xxh3-128")) == 32 and checksum(b"abc", "xxh3-128") != checksum(b"abd", "xxh3-128")
    with pytest.raises(ValueError, match="unknown checksum"):
        checksum(b"", "md5")


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_hf_weights(tensors.items(), str(path), max_shard_bytes=600)  # several shards


@pytest.mark.parametrize(("encoding", "algorithm"), [("xor", "xxh3-128"), ("overwrite", "blake3"), ("xor", "adler32")])
def test_write_then_apply_patches_only_changed_tensors(tmp_path, encoding, algorithm):
    torch.manual_seed(0)
    old = {"a.weight": torch.randn(10, 10), "b.weight": torch.randn(64).to(torch.bfloat16),
           "c.bias": torch.randn(32)}
    new = {**old, "a.weight": old["a.weight"] + 1e-3, "b.weight": old["b.weight"] * 2}
    _checkpoint(tmp_path / "local", old)
    assert len(list((tmp_path / "local").glob("*.safetensors"))) > 1
    changes = [(n, new[n], encode(tensor_bytes(old[n]), tensor_bytes(new[n]), encoding)) for n in ("a.weight", "b.weight")]
    wire = write_delta(tmp_path / "delta", "v2", "v1", changes, encoding, algorithm)
    assert 0 < wire == (tmp_path / "delta" / "data.bin").stat().st_size
    index = json.loads((tmp_path / "delta" / INDEX).read_text())
    assert index["encoding"] == encoding and index["checksum"] == algorithm and len(index["tensors"]) == 2
    assert apply_delta(tmp_path / "local", tmp_path / "delta")["tensors"] == 2
    loaded = {}
    for f in (tmp_path / "local").glob("*.safetensors"):
        loaded.update(load_file(str(f)))
    for name, tensor in new.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_xor_applied_twice_or_to_the_wrong_base_fails_and_leaves_the_checkpoint(tmp_path):
    old = {"w": torch.arange(16, dtype=torch.float32)}
    new = {"w": old["w"] + 1}
    _checkpoint(tmp_path / "local", old)
    write_delta(tmp_path / "d", "v2", "v1", [("w", new["w"], encode(tensor_bytes(old["w"]), tensor_bytes(new["w"]),
                                                                     "xor"))], "xor", "xxh3-128")
    apply_delta(tmp_path / "local", tmp_path / "d")
    before = (tmp_path / "local" / "model.safetensors").read_bytes()
    with pytest.raises(CorruptArtifactError, match="'w' does not match its xxh3-128 checksum"):
        apply_delta(tmp_path / "local", tmp_path / "d")  # xor is an involution: a second apply reverts
    assert (tmp_path / "local" / "model.safetensors").read_bytes() == before
    with pytest.raises(CorruptArtifactError, match=r"\['x'\] are not in"):
        write_delta(tmp_path / "d2", "v3", "v2", [("x", new["w"], b"")], "overwrite", "adler32")
        apply_delta(tmp_path / "local", tmp_path / "d2")


def test_overwrite_is_idempotent(tmp_path):
    old = {"w": torch.zeros(8)}
    new = {"w": torch.ones(8)}
    _checkpoint(tmp_path / "local", old)
    write_delta(tmp_path / "d", "v2", "v1", [("w", new["w"], encode(tensor_bytes(old["w"]), tensor_bytes(new["w"]),
                                                                     "overwrite"))], "overwrite", "xxh3-128")
    for _ in range(2):
        apply_delta(tmp_path / "local", tmp_path / "d")
    assert torch.equal(load_file(str(tmp_path / "local" / "model.safetensors"))["w"], new["w"])


@pytest.mark.slow  # two engines start
def test_delta_sync_into_engines_matches_a_full_sync(cluster, tiny_kit, tmp_path, http):
    """v1 full (first sync), v2 a delta where every weight moved by ~1e-4 relative (an optimizer step), v3 a
    delta where only the MLPs changed: the engines generate exactly what a full disk sync of v3 gives, with
    fewer bytes written."""
    from transformers import AutoConfig

    from slime.config import SyncConfig
    from slime.sync import WeightSyncer

    _, urls = cluster
    hf_config = AutoConfig.from_pretrained(tiny_kit.model_dir)
    base = load_file(str(Path(tiny_kit.model_dir) / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    v2 = {n: t * (1 + 1e-4 * torch.randn(t.shape, generator=gen)) for n, t in base.items()}
    v3 = {n: t * 1.5 if "mlp" in n else t for n, t in v2.items()}
    delta = WeightSyncer(SyncConfig(weight_sync_mode="disk", update_weight_mode="delta",
                                    update_weight_disk_dir=str(tmp_path / "wire"),
                                    update_weight_local_checkpoint_dir=str(tmp_path / "local")), hf_config=hf_config)
    full = WeightSyncer(SyncConfig(weight_sync_mode="disk", update_weight_disk_dir=str(tmp_path / "full")),
                        hf_config=hf_config)
    results = {v: asyncio.run(delta.sync(urls, lambda w=w: iter(w.items()), v))
               for v, w in (("v1", base), ("v2", v2), ("v3", v3))}
    prompt = {"input_ids": [1, 2, 3, 4], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    after_delta = [http.post(f"{u}/generate", json=prompt).json()["output_ids"] for u in urls]
    full_result = asyncio.run(full.sync(urls, lambda: iter(v3.items()), "v3-full"))
    after_full = [http.post(f"{u}/generate", json=prompt).json()["output_ids"] for u in urls]
    assert after_delta == after_full
    total = full_result.bytes
    assert results["v1"].bytes == total  # the first sync is full
    changed = [n for n in base if not torch.equal(base[n], v2[n])]  # in bf16 some tensors round back
    assert len(changed) > len(base) // 2
    assert results["v2"].tensors == len(changed) and results["v2"].bytes < total
    mlp = [n for n in base if "mlp" in n]
    assert results["v3"].tensors == len(mlp) and results["v3"].bytes < total
    print(f"weights: {base[changed[0]].dtype}")
    for v in ("v2", "v3"):
        print(f"delta {v}: {results[v].bytes / 1e6:.2f} MB of {total / 1e6:.2f} MB full "
              f"({results[v].bytes / total:.1%}), {results[v].seconds['total']:.3f} s vs full "
              f"{full_result.seconds['total']:.3f} s")
