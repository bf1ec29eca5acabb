"""Adapter-only weight sync (`sync.lora_sync: adapter`): the engines get the LoRA adapters, not the model.

Each sync writes the trainer's adapters as a PEFT directory (`write(state, dir)`: the trainer's
`lora_export.write_peft_adapter`, peft's own writer) to `{directory}/.lora_adapter_<v>.tmp-*` and publishes
it by renaming it to `{directory}/lora_adapter_<v>/`, so an engine never reads a half-written adapter. Every
engine then swaps it in with SGLang's endpoints, under one fixed name (`ADAPTER_NAME`, what rollout requests
carry as `lora_path`): `/unload_lora_adapter` (required on engines that hold this syncer's previous adapter,
best effort on the others), then `/load_lora_adapter {lora_name, lora_path}`, then `/update_weight_version`
(the load carries no version).
The previous sync's directory is removed unless `keep_files`.

The engines start from the HF checkpoint. When the adapters' base is another checkpoint (a LoRA stage on
a conversion or a full SFT), `base()` gives its weights: the first sync of this syncer writes them to
`{directory}/lora_base/` (every trainer rank drains `base()` then: it may be collective) and every engine
not yet on them loads them (`/update_weights_from_disk`) before its first adapter, as does an engine that
joins later (a restarted one). That first sync's `bytes` include the base.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slime.backends.megatron.hf_export import save_hf_weights
from slime.engines.client import EngineClient
from slime.sync.common import NamedTensors, SyncResult, Timer, in_thread, nbytes, post_all

ADAPTER_NAME = "slime_policy"  # the lora_name every engine holds the policy under; requests' lora_path


def adapter_dir(directory: str | Path, version: str) -> Path:
    """Where adapter sync publishes weight version `version` under `directory`."""
    return Path(directory) / f"lora_adapter_{version}"


def base_dir(directory: str | Path) -> Path:
    """Where adapter sync writes the adapters' base when it is not the engines' HF checkpoint."""
    return Path(directory) / "lora_base"


def publish(directory: Path, target: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)` into a fresh temporary directory beside `target`, then rename it to `target` (replacing
    an older one): readers see the whole directory or none."""
    tmp = directory / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class AdapterSync:
    """Publish the adapters as a PEFT directory, then swap them in on every engine."""

    def __init__(self, directory: str | Path, write: Callable[[dict[str, torch.Tensor], str], None], *,
                 base: Callable[[], NamedTensors] | None = None, hf_config: Any = None, keep_files: bool = False,
                 post_write: Callable[[str, list[str]], Any] | None = None, name: str = ADAPTER_NAME) -> None:
        self.directory = Path(directory)
        self.write = write
        self.base = base
        self.hf_config = hf_config
        self.keep_files = keep_files
        self.post_write = post_write
        self.name = name
        self._previous: Path | None = None
        self._loaded: set[str] = set()  # engine URLs holding this syncer's adapter under `name`
        self._on_base: set[str] = set()  # engine URLs that loaded base_dir (when a base is pushed)
        self._base_written = False

    async def send(self, client: EngineClient, urls: list[str], weights: NamedTensors, version: str,
                   result: SyncResult, timer: Timer, state: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        target = adapter_dir(self.directory, version)
        with timer("export"):
            tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in weights}
            await in_thread(lambda: publish(self.directory, target, lambda tmp: self.write(tensors, str(tmp))))
        result.tensors, result.bytes, result.buckets = len(tensors), sum(map(nbytes, tensors.values())), 1
        if self.post_write is not None:
            with timer("post_write"):
                await in_thread(functools.partial(self.post_write, str(target), list(urls)))
        with timer("transfer"):
            await self._unload(client, urls, state)
        if self.base is not None:
            await self._send_base(client, urls, result, timer, state)
        with timer("transfer"):
            await post_all(client, urls, "/load_lora_adapter", {"lora_name": self.name, "lora_path": str(target)},
                           phase="update", state=state)
            self._loaded |= set(urls)
            await post_all(client, urls, "/update_weight_version", {"new_version": version}, phase="update",
                           state=state)
        if self._previous is not None and self._previous != target and not self.keep_files:
            with timer("cleanup"):
                shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = target

    async def _unload(self, client: EngineClient, urls: list[str], state: str) -> None:
        """The previous adapter off every engine: required where this syncer loaded it, best effort elsewhere (an
        engine that joined, e.g. restarted and given the adapter by the rollout manager, may hold it)."""
        holding = [u for u in urls if u in self._loaded]
        others = [u for u in urls if u not in self._loaded]
        self._loaded -= set(holding)  # a failed unload is not retried: the next load names the problem
        body = {"lora_name": self.name}
        await asyncio.gather(*(client.request("POST", u + "/unload_lora_adapter", json=body) for u in others),
                             return_exceptions=True)  # "does not exist" is the usual answer
        if holding:
            await post_all(client, holding, "/unload_lora_adapter", body, phase="update", state=state)

    async def _send_base(self, client: EngineClient, urls: list[str], result: SyncResult, timer: Timer,
                         state: str) -> None:
        """The base weights, written once (first sync) and loaded by every engine that is not on them yet."""
        path = base_dir(self.directory)
        if not self._base_written:  # the first sync of every trainer rank: base() may be a collective export

            def counted() -> NamedTensors:
                for name, tensor in self.base():
                    result.tensors += 1
                    result.bytes += nbytes(tensor)
                    yield name, tensor

            def write(tmp: Path) -> None:
                save_hf_weights(counted(), str(tmp))
                if self.hf_config is not None:
                    self.hf_config.save_pretrained(str(tmp))

            with timer("base_export"):
                await in_thread(lambda: publish(self.directory, path, write))
            self._base_written = True
        fresh = [u for u in urls if u not in self._on_base]
        if fresh:
            with timer("base_transfer"):
                await post_all(client, fresh, "/update_weights_from_disk", {"model_path": str(path)}, phase="update",
                               state=state)
            self._on_base |= set(fresh)

    async def close(self, client: EngineClient) -> None:
        return None
