"""slime.offload.HostParking: colocated offload through pinned host twins (the GPU cases run on the device)."""

import pytest
import torch

from slime.offload import (
    HostParking,
    frozen_parameter_slots,
    module_slots,
    optimizer_slots,
    unbuffered_parameter_slots,
)

gpu = pytest.mark.gpu


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 64))
    model[2].weight = model[0].weight  # tied, as an LM head with its embedding
    model.register_buffer("inv_freq", torch.arange(8, dtype=torch.float32))
    return model.to(device)


def test_host_tensors_stay_where_they_are():
    """On a CPU-only machine (and for state Adam keeps on the host, such as `step`) nothing is parked."""
    model = _model("cpu")
    parking = HostParking()
    assert parking.park(module_slots(model)) == 0
    assert not parking.parked and parking.host_bytes == 0
    assert parking.unpark() == 0


def test_frozen_parameter_slots_name_only_the_frozen_ones_and_a_tied_one_once():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 5, bias=False))
    model[2].weight = model[0].weight  # tied, as an output layer on the embedding
    model[0].weight.requires_grad_(False)
    model[1].bias.requires_grad_(False)
    assert [key for key, _, _ in frozen_parameter_slots(model, prefix="m.")] == ["m.0.weight", "m.1.bias"]
    [(_, get, put)] = list(frozen_parameter_slots(model[1]))
    put(torch.zeros(4))  # moved by .data: the module's parameter object sees it
    assert get().data_ptr() == model[1].bias.data_ptr() and not model[1].bias.any()


class _Buffer:
    """What `unbuffered_parameter_slots` reads of megatron's `_ParamAndGradBuffer`: its parameters and whether it
    holds them in one contiguous `param_data` (the distributed optimizer's layout) or not (None)."""

    def __init__(self, params: list[torch.nn.Parameter], param_data: torch.Tensor | None) -> None:
        self.params, self.param_data = set(params), param_data


def test_unbuffered_parameter_slots_name_trainable_weights_no_buffer_holds():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 5, bias=False))
    model[2].weight = model[0].weight  # tied: named once
    model[1].bias.requires_grad_(False)  # frozen: frozen_parameter_slots' business
    model.buffers = [_Buffer([model[0].weight, model[1].weight], param_data=None)]  # megatron DDP's attribute
    assert [key for key, _, _ in unbuffered_parameter_slots(model, prefix="p.")] == ["p.0.weight", "p.1.weight"]
    # under the distributed optimizer the buffer's offload moves its parameters itself: none is named
    model.buffers = [_Buffer([model[0].weight], param_data=torch.zeros(1)), _Buffer([model[1].weight], None)]
    assert [key for key, _, _ in unbuffered_parameter_slots(model)] == ["1.weight"]


def test_megatron_ddp_without_the_distributed_optimizer_keeps_weights_outside_its_buffers(tiny_kit):
    """The premise of `unbuffered_parameter_slots`, on the real megatron-core: a DDP-wrapped model without the
    distributed optimizer (one data-parallel rank, the colocated default) has buffers without `param_data`, so
    their `offload_to_cpu(move_params=True)` moves no weight; every trainable parameter must be parked."""
    from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge

    init_megatron(seed=0, megatron={})
    bridge = make_bridge(tiny_kit.model_dir, torch.bfloat16, megatron={"bf16": True})
    [model] = build_model(bridge, tiny_kit.model_dir, wrap_with_ddp=True)
    assert model.buffers and all(buffer.param_data is None for buffer in model.buffers)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    slots = list(unbuffered_parameter_slots(model))
    assert len(slots) == len(trainable) > 0
    assert {id(p) for buffer in model.buffers for p in buffer.params} == trainable  # the same parameters


def test_module_slots_name_a_tied_weight_once():
    names = [key for key, _, _ in module_slots(_model("cpu"))]
    assert names.count("0.weight") == 1 and "2.weight" not in names
    assert "inv_freq" in names and len(names) == len(set(names))


@gpu
def test_module_round_trip_frees_the_gpu_and_reuses_the_pinned_twins():
    model = _model("cuda")
    x = torch.tensor([[1, 2, 3]], device="cuda")
    before = model(x).detach().clone()
    params = {name: p for name, p in model.named_parameters()}
    parking = HostParking()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    moved = parking.park(module_slots(model))
    assert moved == sum(p.numel() * 4 for p in params.values()) + 8 * 4
    assert torch.cuda.memory_allocated() < allocated
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    host = {name: p.data.data_ptr() for name, p in model.named_parameters()}
    parking.unpark()
    assert all(p.is_cuda for p in model.parameters()) and model.inv_freq.is_cuda
    assert all(p is params[name] for name, p in model.named_parameters())  # the same Parameter objects
    assert model[2].weight is model[0].weight
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    with torch.no_grad():
        model[1].weight.add_(1.0)  # a change while on the GPU travels with the next park
    parking.park(module_slots(model))
    assert {name: p.data.data_ptr() for name, p in model.named_parameters()} == host  # no new pinned memory
    parking.unpark()
    assert torch.equal(model[1].weight.cpu(), params["1.weight"].cpu())
    assert not torch.equal(model(x), before)


@gpu
def test_optimizer_round_trip_keeps_adam_exact():
    """Two models trained alike, one with its Adam state parked and unparked between steps: same weights."""
    models = [_model("cuda") for _ in range(2)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    parking = HostParking()
    x = torch.tensor([[1, 2, 3, 4]], device="cuda")
    host_bytes = []
    for _ in range(3):
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        moved = parking.park(optimizer_slots(optimizers[1]))
        state = next(iter(optimizers[1].state.values()))
        assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].is_pinned()
        assert moved > 0
        host_bytes.append(parking.host_bytes)
        parking.unpark()
        assert state["exp_avg"].is_cuda
    assert host_bytes[0] == host_bytes[1] == host_bytes[2]  # the twins of the first park are reused
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
