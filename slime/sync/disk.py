"""Disk mode: the trainer writes HF safetensors, every engine loads them (`/update_weights_from_disk`).

Works with any engine that can read the directory (same host or a shared file system). Each sync
writes `weight_version_<v>/` under the configured directory (model weights plus `config.json`, what
SGLang's loader needs) and removes the directory the previous sync of this process wrote.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from slime.backends.megatron.hf_export import save_hf_weights
from slime.engines.client import EngineClient
from slime.sync.common import NamedTensors, SyncResult, Timer, in_thread, nbytes, post_all


def weights_dir(directory: str | Path, version: str) -> Path:
    """Where disk mode writes weight version `version` under `directory` (a restarted engine loads it there too)."""
    return Path(directory) / f"weight_version_{version}"


class DiskSync:
    """Export to `directory`, then load on every engine."""

    def __init__(self, directory: str | Path, hf_config: Any = None) -> None:
        self.directory = Path(directory)
        self.hf_config = hf_config
        self._previous: Path | None = None

    async def send(self, client: EngineClient, urls: list[str], weights: NamedTensors, version: str,
                   result: SyncResult, timer: Timer, state: str) -> None:
        target = weights_dir(self.directory, version)

        def export() -> None:
            def counted() -> NamedTensors:
                for name, tensor in weights:
                    result.tensors += 1
                    result.bytes += nbytes(tensor)
                    yield name, tensor

            if target.exists():
                shutil.rmtree(target)
            save_hf_weights(counted(), str(target))
            if self.hf_config is not None:
                self.hf_config.save_pretrained(str(target))

        with timer("export"):
            await in_thread(export)
        result.buckets = 1
        with timer("transfer"):
            await post_all(client, urls, "/update_weights_from_disk",
                           {"model_path": str(target), "weight_version": version}, phase="update", state=state)
        if self._previous is not None and self._previous != target:
            with timer("cleanup"):
                shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = target

    async def close(self, client: EngineClient) -> None:
        return None
