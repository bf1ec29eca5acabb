"""The built-in engine's in-place weight updates (weights.py), in process on a tiny model: payload
decoding, checks before anything is copied, storage kept (captured graphs stay valid), casting,
and a gloo weight-update group with a trainer rank in this process."""

import asyncio
import base64
import pickle

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from slime.engines.builtin.sampling import BadRequestError
from slime.engines.builtin.weights import WeightUpdater, decode_named_tensors
from slime.sync.common import in_thread
from slime.sync.distributed import GROUP_NAME, _TrainerGroup, trainer_store
from slime.sync.tensor import _FileSystemSharing, pack_bucket, serialize_named_tensors


@pytest.fixture
def updater(tiny_kit):
    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()
    return WeightUpdater(model, torch.device("cpu"), lambda fn: fn())


def serialized(named):
    with _FileSystemSharing():
        views, flats = pack_bucket(named)
        return serialize_named_tensors(views), flats


def test_tensor_update_copies_in_place_and_casts(updater):
    name = "model.layers.0.mlp.down_proj.weight"
    param = updater.targets.tensors[name]
    pointer = param.data_ptr()
    new = torch.randn(param.shape, dtype=torch.float64)  # another dtype: cast like SGLang's loaders
    text, _flats = serialized([(name, new), ("model.norm.weight", torch.full((param.shape[0],), 2.0))])
    message = updater.from_tensor([text])
    assert "2 tensors" in message
    assert param.data_ptr() == pointer, "the parameter must keep its storage"
    assert torch.equal(param, new.float())
    assert bool((updater.targets.tensors["model.norm.weight"] == 2.0).all())


def test_tied_output_weight_is_known_by_both_names(updater):
    tensors = updater.targets.tensors
    assert tensors["lm_head.weight"].data_ptr() == tensors["model.embed_tokens.weight"].data_ptr()


def test_refusals_name_the_tensor_and_change_nothing(updater):
    name = "model.layers.1.self_attn.k_proj.weight"
    param = updater.targets.tensors[name]
    before = param.clone()
    good = ("model.layers.0.mlp.up_proj.weight", torch.zeros_like(updater.targets.tensors[
        "model.layers.0.mlp.up_proj.weight"]))
    cases = [([good, (name, torch.zeros(param.shape[0] + 1, param.shape[1]))], f"tensor '{name}' has shape"),
             ([good, ("model.layers.9.nothing", torch.zeros(3))], "'model.layers.9.nothing' is not a parameter"),
             ([good, (name, torch.zeros(param.shape, dtype=torch.int32))], f"tensor '{name}' has dtype torch.int32")]
    for named, message in cases:
        text, _flats = serialized(named)
        with pytest.raises(BadRequestError, match=message):
            updater.from_tensor([text])
    assert torch.equal(param, before)
    assert not bool((updater.targets.tensors["model.layers.0.mlp.up_proj.weight"] == 0).all())
    with pytest.raises(BadRequestError, match="non-empty list"):
        updater.from_tensor([])
    with pytest.raises(BadRequestError, match="load_format 'flattened_bucket'"):
        updater.from_tensor(["x"], "flattened_bucket")


def test_payload_may_only_name_torch_rebuilders():
    with pytest.raises(BadRequestError, match="posix.system may not appear"):
        decode_named_tensors(base64.b64encode(pickle.dumps(__import__("os").system)).decode())
    with pytest.raises(BadRequestError, match="cannot decode"):
        decode_named_tensors("not base64 !")
    with pytest.raises(BadRequestError, match="list of \\(name, tensor\\) pairs"):
        decode_named_tensors(base64.b64encode(pickle.dumps([("a", 1)])).decode())


def test_group_requests_are_checked(updater):
    base = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank_offset": 1}
    for body, message in [({**base, "rank_offset": 0}, "rank_offset 0"), ({**base, "backend": "mpi"}, "'mpi'"),
                          ({**base, "backend": "nccl"}, "needs the engine on a CUDA device"),
                          ({"master_address": "127.0.0.1"}, "needs master_address")]:
        with pytest.raises(BadRequestError, match=message):
            updater.init_group(body)
    with pytest.raises(BadRequestError, match="call /init_weights_update_group first"):
        updater.from_distributed({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]})
    with pytest.raises(BadRequestError, match="no weight update group 'nothing'"):
        updater.destroy_group("nothing")


def test_distributed_update_over_gloo(updater):
    name = "model.layers.0.self_attn.v_proj.weight"
    param = updater.targets.tensors[name]
    new = torch.randn(param.shape)
    store = trainer_store("127.0.0.1", 2, dist.default_pg_timeout)
    body = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP_NAME, "backend": "gloo"}

    async def run():
        trainer = in_thread(lambda: _TrainerGroup(store, 2, "gloo", dist.default_pg_timeout))
        await asyncio.to_thread(updater.init_group, body)
        group = await trainer
        sending = in_thread(lambda: group.broadcast([new.to(torch.bfloat16)]))
        message = await asyncio.to_thread(updater.from_distributed, {
            "names": [name], "dtypes": ["bfloat16"], "shapes": [list(param.shape)], "group_name": GROUP_NAME})
        await sending
        return message

    assert "1 tensors" in asyncio.run(run())
    assert torch.equal(param, new.to(torch.bfloat16).float())
    with pytest.raises(BadRequestError, match="already exists"):
        updater.init_group(body)
    assert "destroyed" in updater.destroy_group(GROUP_NAME) and not updater.groups


def test_weights_checker_snapshot_reset_compare(tiny_kit):
    """SGLang's /weights_checker actions (slime's --check-weight-update-equal): after a reset only an update
    that writes every tensor back passes the comparison."""
    from slime.engines.builtin.weights import WeightChecker

    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()
    checker = WeightChecker(model)
    with pytest.raises(BadRequestError, match="no snapshot taken"):
        checker.run("compare")
    original = {name: t.detach().clone() for name, t in model.state_dict().items()}
    assert checker.run("snapshot").startswith("snapshot of")
    assert checker.run("compare").startswith("all ")
    checker.run("reset_tensors")
    assert not any(t.any() for t in model.state_dict().values())
    partial = {k: v for k, v in original.items() if k != "model.norm.weight"}
    checker.targets.copy_in(list(partial.items()))
    with pytest.raises(BadRequestError, match=r"1 of \d+ tensors differ from the snapshot: \['model.norm.weight'\]"):
        checker.run("compare")
    checker.targets.copy_in(list(original.items()))
    assert checker.run("compare").startswith("all ")
    with pytest.raises(BadRequestError, match="unknown action 'checksum'"):
        checker.run("checksum")
