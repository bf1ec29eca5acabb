"""The `GpuMemory` part of the train actor (`slime/ray/train_actor.py`)."""

from __future__ import annotations

import time
from typing import Any


class GpuMemory:
    """Freeing the GPU for the engines between train calls (colocated offload) and taking it back. Part of
    `TrainActor` (slime/ray/train_actor.py), whose state it uses."""

    def offload(self) -> dict[str, Any]:
        """Free the GPU for the engines: the DDP buffers' bf16 weights go to megatron-core's pinned copies
        (gradients are dropped: the next step zeroes them), the optimizer's fp32 main weights and moments to
        pinned host twins kept from step to step (`slime.offload`; megatron-core's own optimizer offload
        copies into fresh pageable memory, 3 s for a 0.5B model's Adam state on an H100), and to the same
        twins what lives outside those: the frozen parameters (a LoRA base, freeze lists), the trainable ones
        where the DDP buffers hold no copy of them (without the distributed optimizer, megatron's buffers keep
        only the gradients) and the KL reference model; the PPO critic's buffers, parameters and optimizer state
        the same way. A no-op on CPU."""
        import torch

        if not torch.cuda.is_available() or self.offloaded:
            return {"offloaded": self.offloaded, "device": "cpu" if not torch.cuda.is_available() else "cuda"}
        t0 = time.monotonic()
        for model in [*self.models, *(self.critic_models or [])]:
            for buffer in [*model.buffers, *model.expert_parallel_buffers]:
                buffer.offload_to_cpu(move_params=True, move_grads=True)
        if self.parking is None:
            from slime.offload import HostParking

            self.parking = HostParking()
        moved = self.parking.park(self._optimizer_slots())
        outside = self.parking.park(self.frozen_slots())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.offloaded = True
        return {"offloaded": True, "device": "cuda", "gpu_bytes": torch.cuda.memory_allocated(),
                "optimizer_bytes": moved, "frozen_bytes": outside, "seconds": time.monotonic() - t0}

    def onload(self) -> dict[str, Any]:
        """Bring the weights and optimizer state back to the GPU after `offload`; a no-op on CPU."""
        import torch

        if not self.offloaded:
            return {"offloaded": False}
        t0 = time.monotonic()
        for model in [*self.models, *(self.critic_models or [])]:
            for buffer in [*model.buffers, *model.expert_parallel_buffers]:
                buffer.reload_from_cpu(move_params=True, move_grads=True)
        self.parking.unpark()
        torch.cuda.synchronize()
        self.offloaded = False
        return {"offloaded": False, "device": "cuda", "gpu_bytes": torch.cuda.memory_allocated(),
                "seconds": time.monotonic() - t0}

    def frozen_slots(self) -> Any:
        """What `offload` moves besides the DDP buffers and the optimizer: each policy chunk's frozen
        parameters, its trainable ones where the DDP buffers do not hold them (without the distributed
        optimizer: `offload.unbuffered_parameter_slots`; the PPO critic's, which never uses it), and every tensor of the reference and OPD teacher
        models (no DDP, never trained)."""
        from slime.offload import frozen_parameter_slots, module_slots, unbuffered_parameter_slots

        for k, model in enumerate(self.models):
            yield from frozen_parameter_slots(model, prefix=f"frozen{k}.")
            yield from unbuffered_parameter_slots(model, prefix=f"policy{k}.")
        for k, model in enumerate(self.critic_models or []):  # built without the distributed optimizer: all here
            yield from unbuffered_parameter_slots(model, prefix=f"critic{k}.")
        for k, model in enumerate(self.ref_models or []):
            yield from module_slots(model, prefix=f"ref{k}.")
        for k, model in enumerate(self.teacher_models or []):
            yield from module_slots(model, prefix=f"teacher{k}.")

    def _optimizer_slots(self) -> Any:
        from slime.backends.megatron.optimizer import torch_optimizers
        from slime.offload import optimizer_slots

        for k, inner in enumerate(torch_optimizers(self.optimizer)):
            yield from optimizer_slots(inner, prefix=k)
        if self.critic_optimizer is not None:
            for k, inner in enumerate(torch_optimizers(self.critic_optimizer)):
                yield from optimizer_slots(inner, prefix=("critic", k))
