"""The weight-sync entry point: choose the mode from the config, bracket every sync, time it.

    syncer = WeightSyncer(config.sync, colocated=config.cluster.same_gpus, hf_config=bridge.hf_config)
    result = await syncer.sync(router.worker_urls(), lambda: export_hf_weights(bridge, models), version)
    await syncer.close()

Every sync runs, on every engine URL (the router does not route these calls):
`/pause_generation` -> `/flush_cache` -> the mode's transfer (the new `weight_version` is set with
the last update call) -> `/continue_generation`, then checks that each engine reports the version.

Failure: a `WeightSyncError` names every engine that refused or could not be reached and the phase.
The engines are then left **paused** (none serves a half-updated model); those that failed during
the transfer may hold a mix of old and new tensors, and none reports the new version. Sync again
(the same or another engine set) to recover; `resume(urls)` continues generation without syncing.

Multi-rank trainers: the weights iterator may be collective (mbridge gathers tensor-parallel shards),
so every trainer rank must drain it; only the rank that calls `sync` (rank 0) talks to the engines.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from slime.config import SyncConfig
from slime.engines.client import EngineClient
from slime.errors import ConfigError
from slime.sync.common import NamedTensors, SyncResult, Timer, WeightSyncError, post_all

logger = logging.getLogger(__name__)

FLUSH_ATTEMPTS = 30  # /flush_cache is refused while requests are still running: retried once a second
PAUSED_STATE = ("The engines are left paused; the ones that failed in the update may hold partly new "
                "weights and keep their old weight_version. Sync again to recover.")


def resolve_mode(config: SyncConfig, colocated: bool) -> str:
    """The transport: `adapter` under `lora_sync: adapter`, else `weight_sync_mode` with `auto` resolved (tensor
    when colocated, distributed otherwise)."""
    if config.lora_sync == "adapter":
        return "adapter"
    if config.weight_sync_mode != "auto":
        return config.weight_sync_mode
    return "tensor" if colocated else "distributed"


class WeightSyncer:
    """One per training run (the distributed mode keeps its process group between syncs)."""

    def __init__(self, config: SyncConfig, *, colocated: bool = False, hf_config: Any = None,
                 master_address: str = "127.0.0.1", backend: str | None = None,
                 post_write: Callable[[str, list[str]], Any] | None = None,
                 write_adapter: Callable[[dict[str, Any], str], None] | None = None,
                 adapter_base: Callable[[], NamedTensors] | None = None) -> None:
        """`write_adapter(state, dir)` writes a PEFT directory (adapter mode: `weights()` then yields PEFT's
        adapter tensors); `adapter_base()` the base weights when the engines' HF checkpoint is not the base."""
        self.config = config
        self.mode = resolve_mode(config, colocated)
        if self.mode == "adapter":
            from slime.sync.adapter import AdapterSync

            if write_adapter is None:
                raise ConfigError("sync.lora_sync adapter: the syncer needs write_adapter (the PEFT writer)")
            directory = config.update_weight_disk_dir or tempfile.mkdtemp(prefix="slime-adapters-")
            self.transport: Any = AdapterSync(directory, write_adapter, base=adapter_base, hf_config=hf_config,
                                              keep_files=config.update_weight_disk_keep_files, post_write=post_write)
        elif self.mode == "disk":
            from slime.sync.disk import DiskSync

            directory = config.update_weight_disk_dir or tempfile.mkdtemp(prefix="slime-weights-")
            if config.update_weight_mode == "delta":
                from slime.sync.delta import DeltaSync

                self.transport = DeltaSync(directory, config.update_weight_local_checkpoint_dir, hf_config,
                                                encoding=config.update_weight_delta_encoding,
                                                algorithm=config.update_weight_delta_checksum,
                                                keep_files=config.update_weight_disk_keep_files,
                                                post_write=post_write)
            else:
                self.transport = DiskSync(directory, hf_config, keep_files=config.update_weight_disk_keep_files,
                                          post_write=post_write)
        elif self.mode == "tensor":
            from slime.sync.tensor import TensorSync

            self.transport = TensorSync(config.update_weight_buffer_size)
        else:
            from slime.sync.distributed import DistributedSync
            from slime.sync.distributed_delta import DeltaFilter

            delta = DeltaFilter(config.update_weight_delta_checksum) if config.update_weight_mode == "delta" else None
            self.transport = DistributedSync(config.update_weight_buffer_size, master_address=master_address,
                                             backend=backend, timeout_s=config.weight_sync_timeout_s, delta=delta)

    async def sync(self, urls: Sequence[str], weights: Callable[[], NamedTensors], weight_version: str | int,
                   *, client: EngineClient | None = None) -> SyncResult:
        """Push `weights()` to every engine at `urls` and set their `weight_version`.

        Pass the loop's `client` to reuse its connections (creating one costs 0.1-0.4 s); it is then
        used without retries for the update calls.
        """
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise WeightSyncError("no engine URL given", phase="start")
        started = time.perf_counter()
        if client is None:
            async with EngineClient() as own:
                return await self._sync(own, urls, weights, str(weight_version), started)
        return await self._sync(client, urls, weights, str(weight_version), started)

    async def _sync(self, client: EngineClient, urls: list[str], weights: Callable[[], NamedTensors],
                    version: str, started: float) -> SyncResult:
        result = SyncResult(self.mode, version, urls)
        timer = Timer()
        timer.seconds["setup"] = time.perf_counter() - started
        with timer("pause"):
            await post_all(client, urls, "/pause_generation", {}, phase="pause", state=PAUSED_STATE)
        with timer("flush"):
            await self._flush(client, urls)
        retries, client.max_retries = client.max_retries, 0  # pause/flush/continue may be retried, updates not
        try:
            await self.transport.send(client, urls, weights(), version, result, timer, PAUSED_STATE)
        except WeightSyncError:
            raise
        except Exception as exc:  # exporting, packing or broadcasting on this side
            raise WeightSyncError(f"{type(exc).__name__}: {exc}", phase="update", state=PAUSED_STATE) from exc
        finally:
            client.max_retries = retries
        with timer("continue"):
            await post_all(client, urls, "/continue_generation", {}, phase="continue", state=PAUSED_STATE)
        with timer("verify"):
            infos = await post_all(client, urls, "/model_info", None, phase="verify", method="GET",
                                   state="Generation has continued.")
        stale = {url: f"reports weight_version {info.get('weight_version')!r}" for url, info in infos.items()
                 if info.get("weight_version") != version}
        if stale:
            raise WeightSyncError(f"engines do not report weight_version {version!r}", phase="verify",
                                  failures=stale, state="Generation has continued.")
        result.seconds = {**timer.seconds, "total": time.perf_counter() - started}
        logger.info("weight sync %s (%s, %s) to %d engine(s): %.1f MB in %d bucket(s), %d tensor(s) sent, %d "
                    "skipped, %.3f s", version, self.mode, self.config.update_weight_mode, len(urls),
                    result.bytes / 1e6, result.buckets, result.tensors, result.skipped, result.seconds["total"])
        return result

    async def _flush(self, client: EngineClient, urls: list[str]) -> None:
        remaining = list(urls)
        for attempt in range(FLUSH_ATTEMPTS):
            try:
                await post_all(client, remaining, "/flush_cache", {}, phase="flush", state=PAUSED_STATE)
                return
            except WeightSyncError as exc:
                refused = {u for u, reason in exc.failures.items() if reason.startswith("HTTP 400")}
                if attempt == FLUSH_ATTEMPTS - 1 or set(exc.failures) - refused:
                    raise  # unreachable engines fail at once; busy ones after the last attempt
                remaining = sorted(refused)
            await asyncio.sleep(1.0)

    async def resume(self, urls: Sequence[str]) -> None:
        """`/continue_generation` on every engine (after a failed sync, to serve the weights they hold)."""
        async with EngineClient() as client:
            await post_all(client, [u.rstrip("/") for u in urls], "/continue_generation", {}, phase="continue",
                           state="")

    async def close(self, client: EngineClient | None = None) -> None:
        """Release what the mode holds between syncs (the distributed group)."""
        if client is not None:
            await self.transport.close(client)
            return
        async with EngineClient(max_retries=0) as own:
            await self.transport.close(own)
