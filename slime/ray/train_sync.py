"""The `WeightSync` part of the train actor (`slime/ray/train_actor.py`)."""

from __future__ import annotations

import os
from typing import Any

from slime.ray.train_weights import snapshot


class WeightSync:
    """Sending the trained weights (or LoRA adapters) to the engines, and --keep-old-actor's host copies. Part of
    `TrainActor` (slime/ray/train_actor.py), whose state it uses."""

    def update_weights(self, urls: list[str], weight_version: int | str) -> dict[str, Any]:
        """Push the current weights to the engines at `urls` (`slime.sync.WeightSyncer`, mode from
        `sync.weight_sync_mode`); the sync metrics. Every rank drains the weight export (it may gather
        tensor-parallel shards); rank 0 alone talks to the engines, so the others return {}."""
        from slime.backends.megatron.bridge import export_hf_weights

        adapter = self.config.sync.lora_sync == "adapter"
        base = self._adapter_base() if adapter else None

        def weights() -> Any:
            if adapter:  # PEFT's adapter tensors (a tensor-parallel collective), slime/sync/adapter.py
                from slime.backends.megatron.lora_export import peft_state_dict

                return iter(peft_state_dict(self.bridge, self.models).items())
            return export_hf_weights(self.bridge, self.models)

        if self.rank != 0:  # the collectives in rank 0's order: the adapters, then (first sync) the base
            for _ in weights():
                pass
            if base is not None and not self._synced_once:
                for _ in base():
                    pass
            self._synced_once = True
            self.keep_old_weights_after_sync()
            return {}
        if self.syncer is None:
            import ray

            from slime.sync import WeightSyncer
            from slime.sync.disk import post_write_hook

            self.syncer = WeightSyncer(self.config.sync, colocated=self.config.cluster.same_gpus,
                                       hf_config=self.bridge.hf_config,
                                       master_address=ray.util.get_node_ip_address(),
                                       post_write=post_write_hook(self.config.as_namespace()),
                                       write_adapter=self._write_adapter if adapter else None, adapter_base=base)
        result = self._loop.run_until_complete(self.syncer.sync(urls, weights, weight_version))
        self.keep_old_weights_after_sync()
        return {**result.metrics(), "sync/weight_version": result.weight_version}

    def _write_adapter(self, state: dict[str, Any], out_dir: str) -> None:
        """Adapter sync's PEFT writer (peft's own, `lora_export.write_peft_adapter`), on the engines' base."""
        from slime.backends.megatron import lora
        from slime.backends.megatron.lora_export import write_peft_adapter

        write_peft_adapter(state, lora.spec_of(self.models[0]), out_dir,
                           base_model=self.config.checkpoint.hf_checkpoint, hf_config=self.bridge.hf_config)

    def _adapter_base(self) -> Any:
        """Adapter sync: the base weights to send once when the adapters' base is not the HF checkpoint the
        engines start from (a LoRA stage on a conversion or a full checkpoint), else None."""

        from slime.backends.megatron import lora
        from slime.backends.megatron.bridge import export_hf_weights

        pointer = lora.base_of(self.models[0])
        hf = self.config.checkpoint.hf_checkpoint
        if pointer is None or (hf and os.path.realpath(pointer["source"]) == os.path.realpath(hf)):
            return None

        def base() -> Any:
            with lora.adapters_disabled(self.models):  # merged_weight gives the base weight itself
                yield from export_hf_weights(self.bridge, self.models)

        return base

    def keep_old_weights_after_sync(self) -> None:
        """--keep-old-actor after the engines got the current weights, as slime: with update_weights_interval 1
        a queue (old := the weights synced before, rollout := now: one-step-off generation trains on rollouts
        of the previous weights), else old := now."""
        if self.old_weights is None:
            return
        if self.config.sync.update_weights_interval == 1:
            self.old_weights, self.rollout_weights = self.rollout_weights, snapshot(self.models)
        else:
            self.old_weights = snapshot(self.models)
