"""The built-in engine's memory budget on a GPU it shares (`--mem-fraction-static`, SGLang's flag name).

With `cluster.share_gpu` a train rank and an engine stay resident on one GPU, so the engine may take only
its part: `fraction` of the GPU's memory. Two things hold it there:

* torch's caching allocator is capped at that fraction for this process
  (`torch.cuda.set_per_process_memory_fraction`): an allocation past it fails in this process instead of
  taking the train rank's memory (the CUDA context, ~0.5 GB, is outside the allocator and not counted);
* the slot KV cache (`kv_cache="slots"`, allocated at the first request) is sized to fit: at most
  `KV_SHARE` of what the budget leaves after the weights and the compile reserve, the rest kept for prefill
  activations, logits and the CUDA graphs' pools; the scheduler then runs at most that many requests at once.
  With `--tp-size N` the budget is each rank's (every rank caps its own process at `fraction` of its GPU) and so
  are the weights (rank 0's slices after sharding) and a slot (num_key_value_heads / N heads): a slot costs each
  rank 1/N of what it costs one unsplit engine, so the same fraction holds about N times the slots (less where
  the replicated embeddings and lm_head leave less of the budget).

The compile reserve is twice the GPU's L2 cache size (2 x 50 MiB on an H100). The engine's torch.compile'd
kernels (sampler, fused norms, rotary and K/V write) are autotuned at their first call with each new shape,
and inductor's benchmarker allocates an L2-sized buffer to flush the cache between timings. Under a tight
budget (160 MiB on an H100) that one allocation failed the first decode's graph capture (`Tried to allocate
50.00 MiB`) once the slot cache held its share; with one L2 size reserved it still failed, 58.7 MiB then
being cached by the allocator in split blocks it cannot hand out whole, hence the second.

Where SGLang measures the GPU's free memory at start-up (and so depends on what the trainer holds then),
this counts only the engine's own allocations: a restarted engine gets the same budget.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

KV_SHARE = 0.5  # of the budget left after the weights and the compile reserve, for the slot KV cache
COMPILE_RESERVE_L2 = 2  # L2 cache sizes kept for inductor's autotuning buffer and the allocator's split blocks


def slot_bytes(model: Any, max_len: int, tp_size: int = 1) -> int:
    """Bytes of one slot of the slot KV cache on one rank: keys and values of `max_len` tokens in every layer, for
    the rank's own key/value heads (`--tp-size N`: each rank holds num_key_value_heads / N of them, tp_shard.py)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * (config.num_key_value_heads // tp_size) * head_dim * max_len * element


def compile_reserve(device: torch.device) -> int:
    """Bytes kept out of the slot cache for inductor's autotuning buffer: twice the GPU's L2 size (see above)."""
    return COMPILE_RESERVE_L2 * int(torch.cuda.get_device_properties(device).L2_cache_size)


def fitting_slots(budget: int, used: int, per_slot: int, reserved: int = 0) -> int:
    """How many KV slots of `per_slot` bytes fit in `KV_SHARE` of what `budget` leaves after `used` bytes
    and `reserved` more."""
    return max(0, int((budget - used - reserved) * KV_SHARE // per_slot))


def apply_memory_budget(scheduler: Any, model: Any, device: torch.device, fraction: float) -> dict[str, Any]:
    """Cap this process at `fraction` of `device`'s memory and size the scheduler's slot cache to fit (see
    the module docstring); what was decided. On the CPU nothing is shared: nothing changes."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1], got {fraction}")
    if device.type != "cuda":
        logger.info("--mem-fraction-static %s: ignored on %s (no GPU memory to share)", fraction, device)
        return {"device": str(device)}
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    total = torch.cuda.get_device_properties(device).total_memory
    budget, weights = int(fraction * total), torch.cuda.memory_allocated(device)
    reserved = compile_reserve(device)
    decided: dict[str, Any] = {"budget_bytes": budget, "weights_bytes": weights, "reserved_bytes": reserved}
    if scheduler.kv_cache == "slots":
        # this rank's share of the heads; every rank allocates the same number of slots (rank 0 announces it) and
        # holds the same weights' share, so what fits here fits on each follower under its own cap (tp_worker.py)
        world = scheduler.tp.world if scheduler.tp is not None else 1
        per_slot = slot_bytes(model, scheduler.context_length, world)
        fit = fitting_slots(budget, weights, per_slot, reserved)
        if fit < 1:
            raise ValueError(
                f"--mem-fraction-static {fraction}: {budget / 2**30:.2f} GiB of the GPU's {total / 2**30:.2f} GiB, "
                f"the weights take {weights / 2**30:.2f} GiB and one request's KV slot ({scheduler.context_length} "
                f"tokens) {per_slot / 2**30:.3f} GiB, with {reserved / 2**20:.0f} MiB kept for compiling: no slot "
                "fits; raise cluster.rollout_gpu_fraction or lower --max-slot-tokens")
        scheduler.max_running_requests = min(scheduler.max_running_requests, fit)
        decided["slots"] = scheduler.max_running_requests
    logger.info("memory budget: %.2f GiB (%.2f of the GPU), weights %.2f GiB%s", budget / 2**30, fraction,
                weights / 2**30, f", {decided['slots']} KV slots" if "slots" in decided else "")
    return decided
