"""Refusals and failures of weight sync against two real built-in engines behind the router: a bad
tensor is a 400 naming it, the engine keeps serving its old weights, a failed sync names the engine
and leaves the engines paused, and the next good sync recovers."""

import asyncio
import base64
import pickle
import time

import pytest
import torch
from safetensors.torch import load_file

from slime.config import SyncConfig
from slime.engines.client import EngineClient
from slime.sync import WeightSyncer, WeightSyncError, distributed
from slime.sync.tensor import _FileSystemSharing, pack_bucket, serialize_named_tensors

GREEDY = {"input_ids": [52, 43, 53, 61], "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                 "ignore_eos": True}}


@pytest.fixture(scope="module")
def hf_weights(tiny_kit):
    return load_file(str(tiny_kit.model_dir / "model.safetensors"))


def noisy(weights, seed, scale=0.05):
    generator = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in weights.items()}


def payload(named):
    with _FileSystemSharing():
        views, flats = pack_bucket(list(named.items()))
        return serialize_named_tensors(views), flats


def state(http, url):
    return http.get(f"{url}/server_info").json()["internal_states"][0]


def greedy(http, url):
    return http.post(f"{url}/generate", json=GREEDY).json()["output_ids"]


def sync(mode, urls, weights, version):
    async def run():
        syncer = WeightSyncer(SyncConfig(weight_sync_mode=mode, update_weight_buffer_size=128 * 1024))
        try:
            return await syncer.sync(urls, lambda: iter(weights.items()), version)
        finally:
            await syncer.close()
    return asyncio.run(run())


def test_tensor_endpoint_refuses_bad_tensors_and_keeps_serving(cluster, http, hf_weights):
    _, urls = cluster
    url = urls[0]
    before = greedy(http, url)
    name = "model.layers.0.mlp.up_proj.weight"
    cases = {
        "model.layers.0.mlp.not_a_weight": ({"model.layers.0.mlp.not_a_weight": hf_weights[name]}, "not a parameter"),
        name: ({name: hf_weights[name][:, :-1] + 1.0, "model.norm.weight": hf_weights["model.norm.weight"] + 1.0},
               "has shape"),
    }
    for bad, (tensors, why) in cases.items():
        text, flats = payload(tensors)
        reply = http.post(f"{url}/update_weights_from_tensor",
                          json={"serialized_named_tensors": [text], "weight_version": "bad"})
        assert reply.status_code == 400, reply.text
        assert reply.json()["success"] is False and bad in reply.json()["message"] and why in reply.json()["message"]
    # a payload that names anything but torch's tensor rebuilders is refused before it runs
    evil = base64.b64encode(pickle.dumps(print)).decode()
    reply = http.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
    assert reply.status_code == 400 and "builtins.print" in reply.json()["message"]
    # nothing was applied (the good norm tensor came with a bad one), the version is unchanged
    assert greedy(http, url) == before
    assert http.get(f"{url}/model_info").json()["weight_version"] != "bad"
    assert state(http, url)["last_weight_update"]["success"] is False


def test_failed_distributed_sync_names_engine_and_tensor_then_recovers(cluster, http, hf_weights):
    router, urls = cluster
    before = [greedy(http, url) for url in urls]
    bad = noisy(hf_weights, 1)
    bad["model.layers.1.self_attn.q_proj.weight"] = bad["model.layers.1.self_attn.q_proj.weight"].T.contiguous()[:-1]
    with pytest.raises(WeightSyncError) as caught:
        sync("distributed", urls, bad, "broken")
    error = caught.value
    assert error.phase == "update" and set(error.failures) == set(urls)
    assert "model.layers.1.self_attn.q_proj.weight" in str(error) and "has shape" in str(error)
    assert "left paused" in str(error)
    for url in urls:
        assert state(http, url)["paused"] is True
        assert http.get(f"{url}/model_info").json()["weight_version"] != "broken"
    # while paused the engines still answer control calls; a good sync recovers them
    good = noisy(hf_weights, 2)
    result = sync("distributed", router.worker_urls(), good, "recovered")
    assert result.buckets > 1 and result.tensors == len(good)
    after = [greedy(http, url) for url in urls]
    assert after[0] == after[1] != before[0]
    assert all(state(http, url)["paused"] is False for url in urls)


def test_unreachable_engine_is_named_and_others_stay_paused(cluster, http, hf_weights):
    _, urls = cluster
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    with pytest.raises(WeightSyncError) as caught:
        sync("tensor", [*urls, dead], hf_weights, "never")
    assert caught.value.phase == "pause" and list(caught.value.failures) == [dead]
    assert dead in str(caught.value)
    assert all(state(http, url)["paused"] is True for url in urls)
    result = sync("tensor", urls, hf_weights, "original")  # back to the kit's weights
    assert result.buckets > 1
    assert all(http.get(f"{url}/model_info").json()["weight_version"] == "original" for url in urls)
    assert all(state(http, url)["paused"] is False for url in urls)


def test_distributed_group_is_reused_and_reformed_when_engines_change(cluster, http, hf_weights):
    _, urls = cluster

    async def run():
        syncer = WeightSyncer(SyncConfig(weight_sync_mode="distributed"))
        async with EngineClient() as client:
            first = await syncer.sync(urls, lambda: iter(hf_weights.items()), "g1", client=client)
            second = await syncer.sync(urls, lambda: iter(hf_weights.items()), "g2", client=client)
            groups_during = [state(http, url)["weight_update_groups"] for url in urls]
            third = await syncer.sync(urls[:1], lambda: iter(hf_weights.items()), "g3", client=client)
            groups_after_change = [state(http, url)["weight_update_groups"] for url in urls]
            await syncer.close(client)
        return first, second, third, groups_during, groups_after_change

    first, second, third, during, after_change = asyncio.run(run())
    assert "connect" in first.seconds and "connect" not in second.seconds and "connect" in third.seconds
    assert during == [["slime_weight_sync"]] * 2
    assert after_change == [["slime_weight_sync"], []], "the engine left out must have left the old group"
    assert [http.get(f"{url}/model_info").json()["weight_version"] for url in urls] == ["g3", "g2"]
    assert [state(http, url)["weight_update_groups"] for url in urls] == [[], []]


def test_trainer_that_cannot_open_its_group_fails_at_once_and_the_next_sync_recovers(cluster, http, hf_weights,
                                                                                     monkeypatch):
    """The trainer's side of the group fails to form while the engines join: they would wait for rank 0 until the
    group timeout; the sync fails as soon as the trainer's side does, saying why, and a later sync forms the group."""
    _, urls = cluster

    class Refusing(distributed._TrainerGroup):
        def __init__(self, store, *args, **kwargs):
            raise RuntimeError(f"process group refused (store on port {store.port})")

    monkeypatch.setattr(distributed, "_TrainerGroup", Refusing)

    async def run(config):
        syncer = WeightSyncer(config)
        try:
            return await syncer.sync(urls, lambda: iter(hf_weights.items()), "after-refused-group")
        finally:
            await syncer.close()

    # the engines' own join attempt gives up after the group timeout: keep it short for the fixture's teardown
    config = SyncConfig(weight_sync_mode="distributed", weight_sync_timeout_s=20)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="could not open the weight-sync group.*process group refused") as caught:
        asyncio.run(run(config))
    assert caught.value.phase == "connect"
    assert time.monotonic() - start < 15, "must not wait for the group timeout"
    monkeypatch.undo()
    result = asyncio.run(run(config))
    assert result.mode == "distributed"
    assert all(http.get(f"{url}/model_info").json()["weight_version"] == "after-refused-group" for url in urls)
    assert all(state(http, url)["paused"] is False for url in urls)


def test_a_master_address_not_of_this_host_is_refused_before_any_engine_is_asked(cluster, http, hf_weights):
    """192.0.2.1 (TEST-NET-1) is no address of this host: the store cannot be bound there, and the sync says so at
    once instead of waiting for its timeout, with no group opened on the engines."""
    _, urls = cluster

    async def run():
        syncer = WeightSyncer(SyncConfig(weight_sync_mode="distributed"), master_address="192.0.2.1")
        try:
            return await syncer.sync(urls, lambda: iter(hf_weights.items()), "unreachable-master")
        finally:
            await syncer.close()

    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"could not open the weight-sync store on 192\.0\.2\.1") as caught:
        asyncio.run(run())
    assert caught.value.phase == "connect" and time.monotonic() - start < 10
    assert all(state(http, url)["weight_update_groups"] == [] for url in urls)  # no engine was asked to join
    assert all(state(http, url)["paused"] is True for url in urls)  # left paused, as after any failed sync
    assert sync("distributed", urls, hf_weights, "after-bad-master").mode == "distributed"  # and it recovers
    assert all(http.get(f"{url}/model_info").json()["weight_version"] == "after-bad-master" for url in urls)
    assert all(state(http, url)["paused"] is False for url in urls)
