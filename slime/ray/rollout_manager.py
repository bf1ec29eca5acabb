"""The rollout manager actor: owns the engines, the router, the data source and the rollout function.

`start()` launches one engine server per engine of the placement (the built-in engine or SGLang, as
`engine.engine` says; on GPUs each with `CUDA_VISIBLE_DEVICES` set to its bundles' GPUs) behind a fresh
sglang-router, then builds slime's flat `args`, the `RolloutDataSource` and the rollout function
(`rollout.rollout_function_path`). `generate(rollout_id)` runs one step and returns the URI of the
committed shard set in the store plus the step's metrics; the trainer reads the samples from the
store, so nothing large travels through Ray. The data-source state (cursor and partial-rollout
buffer) is a JSON dict: the RL loop stores it in the trainer checkpoint's `extra_state` so that both
commit together, and feeds it back with `load_data_source_state` on resume.

`offload`/`onload` release and resume the engines' memory (`/release_memory_occupation`,
`/resume_memory_occupation`); `dispose` stops every process this actor started.

Weight updates go through `begin_weight_update()` (the URLs to sync: serving engines and restarted ones
awaiting weights) and `end_weight_update(version)` (the fleet's version is now `version`; restarted
engines that report it are registered with the router again). With `engine.use_fault_tolerance` a
`HealthMonitor` thread polls the engines; a dead one is restarted (`EngineFleet.restart`, fresh port) and
then re-synced before it serves: at once when the fleet never changed weights (the new process loaded
the same HF checkpoint) or when disk mode left the current version's HF directory in
`sync.update_weight_disk_dir`, otherwise by the trainer's next sync. The monitor is paused while the
engines are offloaded and during a weight update. A rollout in progress goes on on the other engines
(the router and the client retry a request whose engine died). See docs/ray.md, "Fault tolerance".
"""

from __future__ import annotations

import asyncio
import gc
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from slime.config import Config
from slime.engines.client import EngineClient
from slime.engines.fleet import LIVE, EngineFleet
from slime.engines.health import HealthMonitor
from slime.engines.router import broadcast_to_workers
from slime.errors import ConfigError, EngineError
from slime.rollout.outputs import flatten

logger = logging.getLogger(__name__)


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able scalar entries of a metrics dict (what crosses Ray)."""
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | str | bool) or v is None}


class RolloutManager:
    """Run as a Ray actor (`ray.remote(RolloutManager).options(**placement.manager_options())`).

    Args:
        config: `Config.model_dump(mode="json")`.
        engine_devices: GPU ids per engine (`Placement.engine_devices()`); `[[]] * n` on CPU.
        log_dir: where engine and router logs go (default: a new temp dir).
        engine_hosts: per engine, the actor options of the `EngineHost` that starts it on its own node
            (`Placement.engine_host_options()`); None: this actor starts every engine on its node.
        gc_freeze: freeze the garbage collector's view after `start` and after the first step, as the built-in
            engine's server does: a full collection walks every object of the process (torch, transformers,
            the tokenizer, the data), ~0.2 s with the GIL held, and stalls the rollout's event loop while
            the engines wait for requests. Only for a process of its own (the Ray actor: the RL loop sets
            it): frozen objects that later become cyclic garbage are never freed.
    """

    def __init__(self, config: dict[str, Any], engine_devices: list[list[int]], log_dir: str | None = None,
                 engine_hosts: list[dict[str, Any] | None] | None = None, gc_freeze: bool = False) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config = Config.model_validate(config)
        self.engine_devices = engine_devices
        self.engine_hosts = engine_hosts
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="slime-rollout-"))
        self.fleet: EngineFleet | None = None
        self.monitor: HealthMonitor | None = None
        self.weight_version: str | None = None  # None: the engines hold the HF checkpoint they started with
        self.offloaded: list[str] = []  # engines whose memory was released by `offload`
        self._restarts_reported = 0
        self.args: Any = None
        self.data_source: Any = None
        self.rollout_fn: Any = None
        self.eval_fn: Any = None  # eval_function_path, else rollout_fn
        self.log_fns: tuple[Any, Any] = (None, None)  # custom rollout / eval log functions
        self.generator: Any = None  # a FullyAsyncRollout in --async-mode fully
        self.gc_freeze = gc_freeze
        self._gc_freezes = 0  # done: at start, after the first step

    @property
    def router(self) -> Any:
        return None if self.fleet is None else self.fleet.router

    def start(self) -> dict[str, Any]:
        """Launch engines and router, build args, data source and rollout function; the URLs."""
        from transformers import AutoTokenizer

        from slime.data.source import make_data_source
        from slime.rollout import load_rollout_function, rollout_args
        from slime.rollout.hooks import load_eval_function, load_log_functions

        c = self.config
        c.require("checkpoint.hf_checkpoint", "run.run_id", stage="rl")
        if not self.engine_devices:
            raise ConfigError("the placement has no engine (rollout_num_gpus 0): the rollout manager needs one")
        t0 = time.monotonic()
        try:
            self.fleet = EngineFleet(c, c.checkpoint.hf_checkpoint, self.log_dir, self.engine_devices,
                                     self.engine_hosts).start()
            self.args = rollout_args(c, self.router)
            tokenizer = AutoTokenizer.from_pretrained(c.checkpoint.hf_checkpoint)
            self.data_source = make_data_source(c, tokenizer)
            self.rollout_fn = load_rollout_function(self.args)  # signature-checked, as generate_rollout does
            self.eval_fn = load_eval_function(self.args)
            self.log_fns = load_log_functions(self.args)
        except BaseException:
            self.dispose()
            raise
        if c.engine.use_fault_tolerance:
            self.monitor = self._health_monitor()
            self.monitor.start()
        self._freeze_gc()
        logger.info("rollout manager: %d %s engines behind %s in %.1f s", len(self.engine_devices), c.engine.engine,
                    self.router.url, time.monotonic() - t0)
        return {"router_url": self.router.url, "worker_urls": self.worker_urls(),
                "start_time": time.monotonic() - t0}

    def worker_urls(self) -> list[str]:
        """URLs of the engines the router serves from."""
        return self.fleet.urls() if self.fleet is not None else []

    def engines(self) -> list[dict[str, Any]]:
        """Per engine: index, url, pid, state, restarts, devices."""
        return self.fleet.info() if self.fleet is not None else []

    # ------------------------------------------------------------------------- fault tolerance

    def _health_monitor(self) -> HealthMonitor:
        e, fleet = self.config.engine, self.fleet
        return HealthMonitor(lambda: {s.index: s.url for s in fleet.slots if s.state in (*LIVE, "down")},
                             self._recover, fleet.retire, interval_s=e.rollout_health_check_interval,
                             timeout_s=e.rollout_health_check_timeout, first_wait_s=e.rollout_health_check_first_wait,
                             failure_threshold=e.rollout_health_check_failures,
                             max_restarts=e.rollout_max_engine_restarts)

    def _recover(self, index: int) -> None:
        """Health monitor thread: restart engine `index` and bring it to the fleet's weights if that can
        be done here; otherwise it waits (unregistered) for the trainer's next sync."""
        url = self.fleet.restart(index)
        if self.weight_version is None:  # never synced: the new process loaded the same HF checkpoint
            self.fleet.register(index)
            return
        if self.config.sync.lora_sync == "adapter":
            if self._load_adapter(index, url):
                self._register_if_current(index, url)
            return
        path = self._disk_weights(self.weight_version)
        if path is None:
            logger.info("engine %d (%s) waits for the next weight sync (version after %s)", index, url,
                        self.weight_version)
            return
        with httpx.Client(timeout=self.config.sync.weight_sync_timeout_s, trust_env=False) as http:
            answer = http.post(f"{url}/update_weights_from_disk",
                               json={"model_path": str(path), "weight_version": self.weight_version})
        if answer.status_code != 200:
            logger.warning("engine %d: loading %s failed (HTTP %d: %s): it waits for the next weight sync", index,
                           path, answer.status_code, answer.text[:300])
            return
        self._register_if_current(index, url)

    def _load_adapter(self, index: int, url: str) -> bool:
        """Adapter sync: give restarted engine `index` the base (when one was pushed) and the current adapter
        from `sync.update_weight_disk_dir`; False (it waits for the next sync) when they are not there."""
        from slime.sync.adapter import ADAPTER_NAME, adapter_dir, base_dir

        directory = self.config.sync.update_weight_disk_dir
        adapter = adapter_dir(directory, self.weight_version) if directory else None
        if adapter is None or not (adapter / "adapter_config.json").is_file():
            logger.info("engine %d (%s) waits for the next weight sync (adapter of %s not on disk)", index, url,
                        self.weight_version)
            return False
        calls = [("/load_lora_adapter", {"lora_name": ADAPTER_NAME, "lora_path": str(adapter)}),
                 ("/update_weight_version", {"new_version": self.weight_version})]
        if (base_dir(directory) / "config.json").is_file():
            calls.insert(0, ("/update_weights_from_disk", {"model_path": str(base_dir(directory))}))
        with httpx.Client(timeout=self.config.sync.weight_sync_timeout_s, trust_env=False) as http:
            for path, body in calls:
                answer = http.post(f"{url}{path}", json=body)
                if answer.status_code != 200:
                    logger.warning("engine %d: %s failed (HTTP %d: %s): it waits for the next weight sync", index,
                                   path, answer.status_code, answer.text[:300])
                    return False
        return True

    def _disk_weights(self, version: str) -> Path | None:
        """The HF directory disk-mode sync wrote for `version`, when sync.update_weight_disk_dir names it."""
        from slime.sync.disk import weights_dir
        from slime.sync.syncer import resolve_mode

        s = self.config.sync
        if s.update_weight_mode == "delta":  # the local checkpoint holds the newest version
            path = Path(s.update_weight_local_checkpoint_dir)
            return path if (path / "config.json").is_file() else None
        if s.update_weight_disk_dir is None or resolve_mode(s, self.config.cluster.same_gpus) != "disk":
            return None
        path = weights_dir(s.update_weight_disk_dir, version)
        return path if (path / "config.json").is_file() else None

    def begin_weight_update(self) -> list[str]:
        """Before a weight sync: pause health checks (a restart in progress finishes first); the URLs to
        sync, restarted engines awaiting weights included."""
        if self.monitor is not None:
            self.monitor.pause()
        return self.fleet.urls(LIVE)

    def end_weight_update(self, version: str | None) -> dict[str, Any]:
        """After a weight sync to `version` (None: it failed): restarted engines that report `version`
        serve again; health checks resume."""
        registered = 0
        try:
            if version is not None:
                self.weight_version = str(version)
                if self.config.sync.lora_sync == "adapter":  # the policy is an adapter now: requests name it
                    from slime.sync.adapter import ADAPTER_NAME

                    self.args.engine_lora_name = ADAPTER_NAME
                for slot in [s for s in self.fleet.slots if s.state == "awaiting_sync"]:
                    registered += self._register_if_current(slot.index, slot.url)
        finally:
            if self.monitor is not None:
                self.monitor.resume()
        return {"rollout/engines_reregistered": registered}

    def _register_if_current(self, index: int, url: str) -> bool:
        """Register engine `index` when it reports the fleet's weight version (else it keeps waiting)."""
        try:
            with httpx.Client(timeout=30.0, trust_env=False) as http:
                reported = http.get(f"{url}/model_info").json().get("weight_version")
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("engine %d (%s): cannot read its weight version (%s); the health monitor will see to "
                           "it", index, url, exc)
            return False
        if reported != self.weight_version:
            logger.warning("engine %d (%s) reports weight_version %r, the fleet is at %r: not registered", index,
                           url, reported, self.weight_version)
            return False
        self.fleet.register(index)
        return True

    # ------------------------------------------------------------------------- rollout

    def generate(self, rollout_id: int) -> tuple[str, dict[str, Any]]:
        """One rollout step; (URI of its committed shard set, its metrics)."""
        from slime.rollout.store import write_rollout

        t0 = time.monotonic()
        self._check_serving()
        out = self.rollout_fn(self.args, rollout_id, self.data_source)
        metrics = dict(out.metrics)
        uri = metrics.get("rollout/uri") or write_rollout(self.args, rollout_id, out.samples, [], _scalars(metrics))
        return uri, self._step_metrics(rollout_id, out.samples, metrics, uri, time.monotonic() - t0)

    def _step_metrics(self, rollout_id: int, groups: list[Any], metrics: dict[str, Any], uri: str,
                      rollout_time: float) -> dict[str, Any]:
        """A step's metrics as the loop gets them: the custom log function's turn, the URI, engine counts."""
        if self.log_fns[0] is not None and self.log_fns[0](rollout_id, self.args, flatten(groups), metrics,
                                                           rollout_time):
            metrics = {}  # slime: the custom log function did the logging; the step keeps what the loop needs
        metrics["rollout/uri"] = uri
        metrics["perf/rollout_time"] = rollout_time
        restarts = self.fleet.restarts
        metrics["rollout/engine_restarts"] = restarts - self._restarts_reported  # since the last step's
        self._restarts_reported = restarts
        metrics["rollout/engines_serving"] = len(self.worker_urls())
        self._freeze_gc()
        return _scalars(metrics)

    def _freeze_gc(self) -> None:
        """With `gc_freeze`: collect, then freeze what exists (twice in the actor's life: after `start`, and
        after the first step, which imports and caches what the rollout function needs)."""
        if self.gc_freeze and self._gc_freezes < 2:
            self._gc_freezes += 1
            gc.collect()
            gc.freeze()

    # ------------------------------------------------------------------------- fully async

    def start_fully_async(self, version: int, next_rollout_id: int, state: dict[str, Any] | None) -> dict[str, Any]:
        """Start continuous generation (`slime.rollout.fully_async`) at engine weight `version`, the trainer's
        next batch being `next_rollout_id`; `state` (from a checkpoint) restores the groups it held."""
        from slime.rollout.fully_async import FullyAsyncRollout

        c = self.config
        self.generator = FullyAsyncRollout(self.args, self.data_source, batch_groups=c.rollout.rollout_batch_size,
                                           max_lag=c.sync.max_policy_version_lag,
                                           stale_policy=c.sync.stale_sample_policy,
                                           partial=c.rollout.partial_rollout, version=version,
                                           next_rollout_id=next_rollout_id)
        if state is not None:
            self.generator.load_state_dict(state, where=f"checkpoint extra state of batch {next_rollout_id - 1}")
        self.generator.start()
        return {"restored_groups": len(state["completed"]) + len(state["interrupted"]) if state else 0}

    def take_batch(self, rollout_id: int) -> tuple[str, dict[str, Any]]:
        """Fully async: the next batch of finished groups, committed as rollout `rollout_id`'s shard set
        (groups dropped since the last batch under rollout_dropped/); (URI, metrics)."""
        from slime.rollout.store import write_rollout

        t0 = time.monotonic()
        kept, dropped, metrics = self.generator.take_batch(rollout_id)
        uri = write_rollout(self.args, rollout_id, kept, dropped, _scalars(metrics))
        return uri, self._step_metrics(rollout_id, kept, metrics, uri, time.monotonic() - t0)

    def pause_generation(self, snapshot: bool = False) -> dict[str, Any]:
        """Fully async: stop generating (in-flight requests aborted, partial groups held); with `snapshot`
        also everything held, for the checkpoint. {"metrics": ..., "state": ... or None}."""
        metrics = self.generator.pause()
        return {"metrics": metrics, "state": self.generator.state_dict() if snapshot else None}

    def resume_generation(self, version: int) -> None:
        """Fully async: generate again at engine weight `version`."""
        self.generator.resume(version)

    def _check_serving(self) -> None:
        if not self.worker_urls():
            states = ", ".join(f"{e['index']}: {e['state']}" for e in self.engines())
            raise EngineError(f"no engine is serving (engine states: {states}); see the engine logs in "
                              f"{self.log_dir}")

    def eval(self, rollout_id: int) -> dict[str, Any]:
        """Evaluate on the eval datasets (`eval.*`); the metrics (the store holds the samples)."""
        t0 = time.monotonic()
        self._check_serving()
        out = self.eval_fn(self.args, rollout_id, self.data_source, evaluation=True)
        metrics = _scalars(dict(out.metrics))
        if self.log_fns[1] is not None and self.log_fns[1](rollout_id, self.args, out.data, metrics):
            metrics = {}  # slime: the custom eval log function did the logging
        metrics["perf/eval_time"] = time.monotonic() - t0
        return metrics

    def data_source_state(self) -> dict[str, Any]:
        """The data source's cursor and partial-rollout buffer, as JSON."""
        return self.data_source.state_dict()

    def load_data_source_state(self, state: dict[str, Any]) -> None:
        """Restore a state from `data_source_state` (checked against this dataset and settings)."""
        self.data_source.load_state_dict(state)

    def load_slime_cursor(self, cursor: dict[str, int]) -> None:
        """slime's data-source cursor (its `rollout/global_dataset_state_dict_N.pt`, read with a --load of a slime
        checkpoint: megatron_lm.py) over this data source's own settings; slime saves no buffer, so it is empty."""
        state = {**self.data_source.state_dict(), **cursor, "buffer": []}
        self.data_source.load_state_dict(state, where="slime's data-source cursor")

    # ------------------------------------------------------------------------- memory, shutdown

    def check_weights(self, action: str) -> dict[str, Any]:
        """slime's --check-weight-update-equal: SGLang's /weights_checker `action` on every serving engine."""
        return self._broadcast(self.fleet.urls(), "/weights_checker", {"action": action})

    def _broadcast(self, urls: list[str], path: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        async def send() -> dict[str, Any]:
            async with EngineClient() as client:
                return await broadcast_to_workers(client, urls, path, payload or {})

        try:
            return asyncio.run(send())
        except EngineError as exc:
            if self.monitor is None:
                raise
            # every live engine got the call; a dead one is the health monitor's to restart
            logger.warning("%s did not reach every engine (fault tolerance goes on): %s", path, exc)
            return {}

    def offload(self) -> dict[str, Any]:
        """Release every engine's memory (weights and KV cache) while the trainer runs; health checks pause."""
        t0 = time.monotonic()
        if self.monitor is not None:
            self.monitor.pause()
        self.offloaded = self.fleet.urls(LIVE)
        self._broadcast(self.offloaded, "/release_memory_occupation")
        return {"perf/offload_rollout_time": time.monotonic() - t0}

    def onload(self) -> dict[str, Any]:
        """Resume the memory of the engines `offload` released; health checks resume."""
        t0 = time.monotonic()
        if self.offloaded:
            self._broadcast(self.offloaded, "/resume_memory_occupation")
        self.offloaded = []
        if self.monitor is not None:
            self.monitor.resume()
        return {"perf/onload_rollout_time": time.monotonic() - t0}

    def dispose(self) -> None:
        """Stop generation, the health monitor, the router and every engine this actor started (idempotent)."""
        if self.generator is not None:
            self.generator.stop()
            self.generator = None
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None
