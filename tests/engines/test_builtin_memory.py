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
