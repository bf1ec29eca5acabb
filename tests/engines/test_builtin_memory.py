"""The built-in engine's memory budget on a shared GPU (slime/engines/builtin/memory.py): the slot size it
plans with is what the slot cache allocates, the arithmetic of the slots that fit, and that the budget
changes nothing on the CPU (the CUDA cap is checked in test_builtin_engine_gpu.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engines.builtin.memory import KV_SHARE, apply_memory_budget, fitting_slots, slot_bytes
from slime.engines.builtin.scheduler import Scheduler
from slime.engines.builtin.slots import SlotDecoder


@pytest.fixture(scope="module")
def model(tiny_kit):
    return AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.bfloat16).eval()


def test_slot_bytes_is_what_the_slot_cache_allocates(model):
    decoder = SlotDecoder(model, slots=3, max_len=40, device=torch.device("cpu"), cuda_graphs=False)
    allocated = sum(t.numel() * t.element_size() for t in decoder.keys + decoder.values)
    assert slot_bytes(model, 40) * 3 == allocated


def test_fitting_slots_leaves_the_rest_of_the_budget_for_activations():
    gib = 2**30
    # 40 GiB budget, 1 GiB of weights: KV_SHARE of the other 39 GiB in slots of 48 MiB
    assert fitting_slots(40 * gib, gib, 48 * 2**20) == int(39 * gib * KV_SHARE // (48 * 2**20))
    assert fitting_slots(gib, gib, 1) == 0 and fitting_slots(gib, 2 * gib, 1) == 0  # nothing left, or over
    # the compile reserve (inductor's L2-sized autotuning buffer) comes off before the KV share
    assert fitting_slots(40 * gib, gib, 48 * 2**20, 50 * 2**20) == int((39 * gib - 50 * 2**20) * KV_SHARE
                                                                       // (48 * 2**20))
    assert fitting_slots(gib, gib // 2, 1, gib // 2) == 0


def test_budget_changes_nothing_on_the_cpu(model, tiny_kit):
    from transformers import AutoTokenizer

    scheduler = Scheduler(model, AutoTokenizer.from_pretrained(tiny_kit.model_dir), device=torch.device("cpu"),
                          max_running_requests=64)
    assert apply_memory_budget(scheduler, model, torch.device("cpu"), 0.25) == {"device": "cpu"}
    assert scheduler.max_running_requests == 64
    with pytest.raises(ValueError, match="must be in"):
        apply_memory_budget(scheduler, model, torch.device("cpu"), 1.5)


class _Ranks:
    """What the slot decoder and the budget read of a tensor-parallel group (tp_group.TensorParallel)."""

    def __init__(self, world):
        self.world = world

    def announce(self, *args):
        pass


def test_a_tensor_parallel_rank_plans_and_allocates_its_own_kv_heads(model):
    """--tp-size 2: each rank's slot holds num_key_value_heads / 2 heads; the plan is what the decoder allocates."""
    assert model.config.num_key_value_heads % 2 == 0
    decoder = SlotDecoder(model, slots=3, max_len=40, device=torch.device("cpu"), cuda_graphs=False, tp=_Ranks(2))
    allocated = sum(t.numel() * t.element_size() for t in decoder.keys + decoder.values)
    assert slot_bytes(model, 40, 2) * 3 == allocated
    assert slot_bytes(model, 40, 2) * 2 == slot_bytes(model, 40) == slot_bytes(model, 40, 1)


@pytest.mark.parametrize("world", [1, 2])
def test_the_budget_sizes_the_slots_for_this_ranks_heads(model, monkeypatch, world):
    """apply_memory_budget on a (faked) 80 GiB GPU with 1 GiB of weights: TP 1 gets the slots of the whole heads'
    slot size, as before; a TP 2 rank, whose slot is half that, about twice as many in the same budget."""
    import types

    from slime.engines.builtin import memory

    gib = 2**30
    l2 = 50 * 2**20
    monkeypatch.setattr(memory.torch.cuda, "set_per_process_memory_fraction", lambda fraction, device: None)
    monkeypatch.setattr(memory.torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=80 * gib, L2_cache_size=l2))
    monkeypatch.setattr(memory.torch.cuda, "memory_allocated", lambda device: gib)
    scheduler = types.SimpleNamespace(kv_cache="slots", context_length=4096, max_running_requests=10**9,
                                      tp=_Ranks(world) if world > 1 else None)
    decided = apply_memory_budget(scheduler, model, torch.device("cuda", 0), 0.5)
    whole = slot_bytes(model, 4096)  # one slot of all the KV heads
    # by hand: 0.5 x 80 GiB = 40 GiB, minus 1 GiB of weights and 2 x 50 MiB kept for compiling, half of it for KV
    expected = int((40 * gib - gib - 2 * l2) * KV_SHARE // (whole // world))
    assert decided["slots"] == scheduler.max_running_requests == expected
    if world == 2:
        one = int((40 * gib - gib - 2 * l2) * KV_SHARE // whole)
        assert expected in (2 * one, 2 * one + 1)
