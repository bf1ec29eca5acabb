"""Delta weight sync over the distributed transport (slime/sync/distributed_delta.py): the fingerprint that
decides "changed", the built-in engine's checksum check of what it received, and (slow) a delta sync into
two built-in engines over gloo against a full distributed sync of the same weights."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from slime.delta_codec import checksum, host_bytes
from slime.engines.builtin.sampling import BadRequestError
from slime.sync.common import SyncResult, in_thread
from slime.sync.distributed import GROUP_NAME, _TrainerGroup, trainer_store
from slime.sync.distributed_delta import CHUNK, DeltaFilter, fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_sees_every_single_bit_flip(dtype):
    torch.manual_seed(0)
    t = torch.randn(7, 13).to(dtype)  # 91 elements: bf16 has no whole number of int32 words (bytes path)
    base = fingerprint(t).tolist()
    assert fingerprint(t.clone()).tolist() == base
    raw = t.view(torch.uint8).reshape(-1)
    for position in range(0, raw.numel(), 5):
        for bit in (0, 7):
            flipped = raw.clone()
            flipped[position] ^= 1 << bit
            assert fingerprint(flipped.view(dtype).reshape(t.shape)).tolist() != base, (position, bit)
    swapped = t.reshape(-1).clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, other places: the position-weighted sum differs
    assert fingerprint(swapped).tolist() != base


def test_fingerprint_of_a_tensor_longer_than_a_chunk_and_of_a_view():
    t = torch.zeros(CHUNK + 3, dtype=torch.int32)
    base = fingerprint(t).tolist()
    t[CHUNK + 1] = 1  # in the second chunk
    assert fingerprint(t).tolist() != base
    column = torch.randn(6, 4)[:, 1]  # not contiguous
    assert fingerprint(column).tolist() == fingerprint(column.contiguous()).tolist()


def test_filter_keys_cpu_tensors_by_the_configured_checksum_and_reuses_it():
    f = DeltaFilter("blake3")
    t = torch.randn(10)
    assert f.key("w", t)[2] == checksum(host_bytes(t), "blake3")
    assert f.checksums(["w", "x"], [t, t * 2]) == [checksum(host_bytes(t), "blake3"),
                                                   checksum(host_bytes(t * 2), "blake3")]


def test_filter_sends_all_first_then_only_changes_and_everything_after_a_reset():
    weights = {"a": torch.ones(4), "b": torch.zeros(3), "c": torch.arange(5.0)}
    f = DeltaFilter()
    result = SyncResult("distributed", "1", [])
    assert [n for n, _ in f.select(weights.items(), result)] == ["a", "b", "c"] and result.skipped == 0
    f.commit()
    weights["b"] = weights["b"] + 1
    result = SyncResult("distributed", "2", [])
    assert [n for n, _ in f.select(weights.items(), result)] == ["b"] and result.skipped == 2
    f.reset()  # a failed sync: unknown engine state
    assert len(list(f.select(weights.items(), SyncResult("distributed", "3", [])))) == 3
    f.commit()
    weights["c"] = weights["c"].to(torch.float64)  # same values, another dtype: changed
    assert [n for n, _ in f.select(weights.items(), SyncResult("distributed", "4", []))] == ["c"]


@pytest.fixture
def updater(tiny_kit):
    from transformers import AutoModelForCausalLM

    from slime.engines.builtin.weights import WeightUpdater

    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()
    return WeightUpdater(model, torch.device("cpu"), lambda fn: fn())


def test_engine_checks_the_received_checksums_before_applying(updater):
    names = ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    params = [updater.targets.tensors[n] for n in names]
    before = [p.detach().clone() for p in params]
    new = [torch.randn(p.shape) for p in params]
    store = trainer_store("127.0.0.1", 2, dist.default_pg_timeout)
    body = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP_NAME, "backend": "gloo"}
    sums = [checksum(host_bytes(t), "blake3") for t in new]

    async def update(checksums):
        sending = in_thread(lambda: group.broadcast(new))
        try:
            return await asyncio.to_thread(updater.from_distributed, {
                "names": names, "dtypes": ["float32"] * 2, "shapes": [list(p.shape) for p in params],
                "group_name": GROUP_NAME, "checksums": checksums, "checksum_algorithm": "blake3"})
        finally:
            await sending

    async def run():
        nonlocal group
        trainer = in_thread(lambda: _TrainerGroup(store, 2, "gloo", dist.default_pg_timeout))
        await asyncio.to_thread(updater.init_group, body)
        group = await trainer
        with pytest.raises(BadRequestError, match=rf"tensor '{names[1]}': the received bytes have blake3 checksum "
                                                  r"\w+, the trainer sent 0+: corrupted in transfer; nothing"):
            await update([sums[0], "0" * 64])
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))  # nothing applied
        with pytest.raises(BadRequestError, match="one checksum per name"):
            await update(sums[:1])
        assert "2 tensors" in await update(sums)

    group = None
    asyncio.run(run())
    assert all(torch.equal(p, n) for p, n in zip(params, new, strict=True))
    updater.destroy_group(GROUP_NAME)


def _checker(http, urls, action):
    for url in urls:
        answer = http.post(f"{url}/weights_checker", json={"action": action})
        assert answer.status_code == 200, answer.text


def _perturb(weights, generator, only=None):
    """An optimizer-step-like move (~1e-4 relative) of every tensor, or of those whose name contains `only`."""
    return {n: t * (1 + 1e-4 * torch.randn(t.shape, generator=generator)) if only is None or only in n else t
            for n, t in weights.items()}


@pytest.mark.slow  # two engines start; ~25 syncs
def test_distributed_delta_into_engines_matches_a_full_sync(cluster, tiny_kit, http, monkeypatch):
    """Over gloo into two built-in engines: the first delta sync is full, a partial change sends only the changed
    tensors (fewer bytes) and leaves the engines' weights equal to a full distributed sync's; a sync with nothing
    changed still sets the version; an injected checksum mismatch is refused naming the tensor, and the next sync
    is full. Then (printed with -s) bytes and seconds: full vs delta, every weight changed vs only the MLPs."""
    from slime.config import SyncConfig
    from slime.sync import WeightSyncer, WeightSyncError

    _, urls = cluster
    delta_config = SyncConfig(weight_sync_mode="distributed", update_weight_mode="delta")
    full_config = SyncConfig(weight_sync_mode="distributed")
    base = load_file(str(Path(tiny_kit.model_dir) / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    mlp = [n for n in base if ".mlp." in n]
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())

    async def syncs(config, steps):
        syncer = WeightSyncer(config, backend="gloo")
        try:
            return [await syncer.sync(urls, lambda w=w: iter(w.items()), v) for v, w in steps]
        finally:
            await syncer.close()

    v2 = {n: t * 1.5 if n in mlp else t for n, t in base.items()}
    r1, r2, r3 = asyncio.run(syncs(delta_config, [("v1", base), ("v2", v2), ("v3", v2)]))
    assert (r1.tensors, r1.skipped, r1.bytes) == (len(base), 0, full_bytes)  # the first sync is full
    assert (r2.tensors, r2.skipped) == (len(mlp), len(base) - len(mlp))
    assert r2.bytes == sum(v2[n].numel() * v2[n].element_size() for n in mlp) < full_bytes
    assert (r3.tensors, r3.skipped, r3.bytes, r3.buckets) == (0, len(base), 0, 0)  # nothing changed: version only
    for url in urls:
        assert http.get(f"{url}/model_info").json()["weight_version"] == "v3"
    _checker(http, urls, "snapshot")  # the engines' weights after the deltas
    _checker(http, urls, "reset_tensors")  # zeros: a full sync must write every tensor
    (full,) = asyncio.run(syncs(full_config, [("v3-full", v2)]))
    assert full.tensors == len(base) and full.bytes == full_bytes
    _checker(http, urls, "compare")  # bit-equal to the delta's result

    # an injected mismatch: the engines refuse naming the tensor, keep their version; the next sync is full
    corrupt = "model.embed_tokens.weight"
    v4 = {n: t + 1 if n == corrupt else t for n, t in v2.items()}
    real = DeltaFilter.checksums

    def wrong_for_embedding(self, names, tensors):
        return [s if n != corrupt else "0" * len(s) for n, s in zip(names, real(self, names, tensors), strict=True)]

    async def mismatch_then_retry():
        syncer = WeightSyncer(delta_config, backend="gloo")
        try:
            await syncer.sync(urls, lambda: iter(v2.items()), "v3b")
            monkeypatch.setattr(DeltaFilter, "checksums", wrong_for_embedding)
            with pytest.raises(WeightSyncError, match=rf"(?s)phase 'update'.*tensor '{corrupt}': the received bytes "
                                                      r"have xxh3-128 checksum \w+, the trainer sent 0+"):
                await syncer.sync(urls, lambda: iter(v4.items()), "v4")
            assert all(http.get(f"{u}/model_info").json()["weight_version"] == "v3b" for u in urls)
            monkeypatch.setattr(DeltaFilter, "checksums", real)
            return await syncer.sync(urls, lambda: iter(v4.items()), "v4")
        finally:
            await syncer.close()

    retry = asyncio.run(mismatch_then_retry())
    assert (retry.tensors, retry.skipped) == (len(base), 0)  # the sync after the failure is full
    for url in urls:
        assert http.get(f"{url}/model_info").json()["weight_version"] == "v4"

    # measurement: 1 warm-up (forms the group; for delta the full first sync) + 7 timed syncs per case
    repeats, table = 7, {}
    for k, (case, only) in enumerate((("every weight changed", None), ("only the MLPs changed", ".mlp."))):
        steps, w = [], v4
        for i in range(repeats + 1):
            w = _perturb(w, gen, only)
            steps.append((f"bench{k}-{i}", w))
        for label, config in (("full", full_config), ("delta", delta_config)):
            timed = asyncio.run(syncs(config, steps))[1:]
            table[(case, label)] = timed
            if label == "delta" and only is not None:
                assert all(r.tensors == len(mlp) and r.bytes < full_bytes for r in timed)
    print(f"\ntiny kit fp32, {len(base)} tensors, {full_bytes / 1e6:.2f} MB; 2 engines, gloo; median of {repeats}")
    print("| case | sync | tensors sent / skipped | sync/bytes | median total s (min) | export s | transfer s | checksum s |")
    for (case, label), timed in table.items():
        totals = [r.seconds["total"] for r in timed]
        print(f"| {case} | {label} | {timed[0].tensors} / {timed[0].skipped} | {timed[0].bytes / 1e6:.2f} MB | "
              f"{statistics.median(totals):.3f} ({min(totals):.3f}) | "
              f"{statistics.median(r.seconds.get('export', 0) for r in timed):.4f} | "
              f"{statistics.median(r.seconds.get('transfer', 0) for r in timed):.3f} | "
              f"{statistics.median(r.seconds.get('checksum', 0) for r in timed):.4f} |")
