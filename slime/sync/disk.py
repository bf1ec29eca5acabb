"""Disk mode: the trainer writes HF safetensors, every engine loads them (`/update_weights_from_disk`).

Works with any engine that can read the directory (same host or a shared file system). Each sync
writes `weight_version_<v>/` under the configured directory (model weights plus `config.json`, what
SGLang's loader needs) and removes the directory the previous sync of this process wrote, unless
`keep_files` (slime's --update-weight-disk-keep-files). `post_write(version_dir, urls)` runs after the
files are written and before any engine reads them (slime's --custom-update-weight-post-write-path:
publish the writes on a file system without cross-host visibility).
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slime.backends.megatron.hf_export import save_hf_weights
from slime.engines.client import EngineClient
from slime.plugins import load_plugin_field
from slime.sync.common import NamedTensors, SyncResult, Timer, in_thread, nbytes, post_all

POST_WRITE_PARAMS = ["args", "version_dir", "rollout_engines"]


def post_write_hook(args: Any) -> Callable[[str, list[str]], Any] | None:
    """slime's `hook(args, version_dir, rollout_engines)` from --custom-update-weight-post-write-path, checked,
    bound to `args` (None when unset). `rollout_engines` here is the list of engine URLs (slime: Ray handles)."""
    hook = load_plugin_field(args, "custom_update_weight_post_write_path", POST_WRITE_PARAMS, is_async=False)
    return None if hook is None else functools.partial(hook, args)


def weights_dir(directory: str | Path, version: str) -> Path:
    """Where disk mode writes weight version `version` under `directory` (a restarted engine loads it there too)."""
    return Path(directory) / f"weight_version_{version}"


class DiskSync:
    """Export to `directory`, then load on every engine."""

    def __init__(self, directory: str | Path, hf_config: Any = None, *, keep_files: bool = False,
                 post_write: Callable[[str, list[str]], Any] | None = None) -> None:
        self.directory = Path(directory)
        self.hf_config = hf_config
        self.keep_files = keep_files
        self.post_write = post_write
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
        if self.post_write is not None:
            with timer("post_write"):
                await in_thread(functools.partial(self.post_write, str(target), list(urls)))
        result.buckets = 1
        with timer("transfer"):
            await post_all(client, urls, "/update_weights_from_disk",
                           {"model_path": str(target), "weight_version": version}, phase="update", state=state)
        if self._previous is not None and self._previous != target and not self.keep_files:
            with timer("cleanup"):
                shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = target

    async def close(self, client: EngineClient) -> None:
        return None
