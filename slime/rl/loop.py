"""The RL loop as steps: set up the Ray actors once, then per rollout id rollout -> train -> save ->
sync -> eval, each step a method that returns a small JSON-able dict (what a Prefect task per step
returns). `run_rl` in `slime.rl` drives it; every Ray handle stays inside the `RLLoop` object.

Order of one iteration (slime's `train.py`; `train_async.py` with `sync.async_mode`):

    maybe_eval(id, before_train=True)     only at rollout 0 of a fresh run, unless skip_eval_before_train
    rollout(id)       the shard set URI; async: also launches generate(id+1) before returning
    train(id, uri)    the train group's global metrics
    maybe_save(id)    every save_interval and at the last rollout: checkpoint + data-source state + the
                      step's record so far (a rerun finishes a step cut after its save: eval, metrics line)
    sync(id)          every update_weights_interval (and before a due eval): weights -> engines,
                      weight_version = id+1; async: waits for the in-flight generate(id+1) first
    maybe_eval(id)    every eval_interval and at the last rollout, on weight version id+1
    log_step(id)      one line of {store}/{run_id}/rl/metrics.jsonl (and TensorBoard); the record

Fully async with an eval fleet (`cluster.eval_num_gpus`, slime.rl.eval_fleet): the sync of an eval step
pushes the weights to the fleet too, `maybe_eval` launches the eval there and returns, and the result is
logged when it ends (its own metrics line, keyed by rollout id, weight version and checkpoint); the last
step waits for it.

Colocated (`offload_rollout` / `offload_train`, default: `colocate`): engines release their memory
after each rollout and take it back before the sync; train ranks take theirs back before training
and release it after the sync. Ordering guarantee used for resume: the rollout manager is a
single-threaded actor, so `data_source_state()` submitted right after `generate(id)` returns the
state after exactly batch id, even when generate(id+1) is already queued behind it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from slime.config import Config
from slime.config.layout import check_layout, local_model_config
from slime.errors import ConfigError, NotCommittedError
from slime.ray.placement import RayCluster, check_across_nodes, create_placement
from slime.ray.rollout_manager import RolloutManager
from slime.ray.train_group import TrainGroup
from slime.rl.eval_fleet import EvalFleet
from slime.rl.metrics import MetricsLog, check_tensorboard, headline, jsonable, read_metrics
from slime.rl.stale import set_aside_stale_steps
from slime.rl.tracking import WandbLogger, check_wandb
from slime.signals import keep_sigterm_handler, unwrap_signal_errors
from slime.storage import ArtifactStore
from slime.storage.fs import is_local, open_fs

logger = logging.getLogger(__name__)

STAGE = "rl"
CLOSE_TIMEOUT_S = 600.0  # dispose waits behind a generate already running in the rollout manager


def _due(rollout_id: int, interval: int | None, num_rollout: int) -> bool:
    """slime's periodic rule: every `interval` rollouts, counting from 1, and at the last one."""
    return bool(interval) and ((rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout)


def _offloads(config: Config) -> tuple[bool, bool]:
    """(offload_rollout, offload_train); None means: as colocate."""
    c = config.cluster
    rollout = c.colocate if c.offload_rollout is None else c.offload_rollout
    train = c.colocate if c.offload_train is None else c.offload_train
    return rollout, train


def check_rl_config(config: Config) -> None:
    """Everything the loop needs, checked before any process starts."""
    # no prompt data: slime's debug mode trains on stored rollouts; without the global dataset the rollout
    # function makes the prompts (and there is no data size to count rollouts from)
    if config.run.debug_train_only or config.data.disable_rollout_global_dataset:
        config.require("checkpoint.hf_checkpoint", "run.run_id", "rollout.rollout_batch_size", "rollout.num_rollout",
                       stage=STAGE)
    elif config.data.data_source_path != type(config.data).model_fields["data_source_path"].default:
        config.require("checkpoint.hf_checkpoint", "run.run_id", "rollout.rollout_batch_size", stage=STAGE)
    else:
        config.require("checkpoint.hf_checkpoint", "run.run_id", "rollout.rollout_batch_size", "data.prompt_data",
                       stage=STAGE)
    # the train ranks' TP x PP x DP and the engines' split of the model, from the checkpoint's config.json
    check_layout(config, local_model_config(config.checkpoint.hf_checkpoint))
    if config.rollout.num_rollout is None and config.data.num_epoch is None:
        raise ConfigError("stage 'rl' needs rollout.num_rollout (--num-rollout) or data.num_epoch (--num-epoch)")
    e = config.eval
    if e.eval_interval and not (e.eval_prompt_data or e.eval_config):
        raise ConfigError("eval.eval_interval is set but there is no eval dataset: set eval.eval_prompt_data "
                          "(--eval-prompt-data name path) or eval.eval_config, or unset eval_interval")
    offload_rollout, _ = _offloads(config)
    if config.sync.async_mode != "off" and offload_rollout:
        raise ConfigError(f"sync.async_mode {config.sync.async_mode} generates while training: "
                          "cluster.offload_rollout must be false (engines cannot release their memory during a "
                          "rollout)")
    if config.sync.async_mode == "fully" and (config.run.debug_rollout_only or config.run.debug_train_only):
        raise ConfigError("sync.async_mode fully needs both the trainer and the engines: it cannot run with "
                          "run.debug_rollout_only or run.debug_train_only")
    check_tensorboard(config.run.use_tensorboard)
    check_wandb(config)
    from slime.rollout.hooks import check_rollout_plugins  # imports the user's plugin modules

    check_rollout_plugins(config, load_tokenizer=False)  # here, before Ray: a bad plugin path is one line, not a Ray actor's traceback
    if config.run.use_tensorboard and not config.run.tensorboard_dir:
        store = ArtifactStore.from_config(config)
        if not is_local(open_fs(store.root, store.storage_options)[0]):
            raise ConfigError(f"run.use_tensorboard with the remote store {store.root}: set run.tensorboard_dir "
                              "(--tensorboard-dir) to a local directory")


class RLLoop:
    """One RL run on Ray. `setup()` first, `close()` always (idempotent; also after errors)."""

    def __init__(self, config: Config, *, log_dir: str | None = None, num_cpus: int | None = None,
                 num_gpus: int | None = None, staging: Any = None) -> None:
        check_rl_config(config)
        # slime.storage.staging.Staging of `config` (its remote checkpoints staged on the driver): train ranks on
        # other nodes stage their own copies from its remote URLs (slime/storage/node_staging.py)
        self.staging = staging
        self.config = config.model_copy(deep=True)
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.offload_rollout, self.offload_train = _offloads(config)
        self.fully_async = config.sync.async_mode == "fully"
        self._generation_paused = False  # fully async: paused for a checkpoint, until the sync resumes it
        self.store = ArtifactStore.from_config(config)
        # engine and router logs: with the run's other outputs, {store}/{run_id}/rl/logs (a temporary
        # directory on a remote store: engines write plain files)
        self.log_dir = log_dir or self.store.local_dir(config.run.run_id, STAGE, "logs")
        self.metrics_uri = self.store.uri(config.run.run_id, STAGE, "metrics.jsonl")
        self.cluster: Any = None  # a RayCluster this loop started (None: joined an initialised Ray)
        self.placement: Any = None
        self.manager: Any = None
        self.train_group: Any = None
        self.eval_fleet: EvalFleet | None = None  # fully async with cluster.eval_num_gpus
        self.metrics_log: MetricsLog | None = None
        self.num_rollout = 0
        self.start_rollout_id = 0
        self.weight_version = 0
        self.worker_urls: list[str] = []
        self.last_checkpoint: str | None = None
        self._inflight: dict[int, tuple[Any, Any]] = {}  # rollout id -> (generate ref, data-source state ref)
        self._ready: dict[int, tuple[str, dict[str, Any]]] = {}  # generated, not yet handed out
        self._states: dict[int, Any] = {}  # rollout id -> ref of the data-source state after its batch
        self._steps: dict[int, dict[str, Any]] = {}  # rollout id -> merged metrics of the step
        self._evaluated: set[int] = set()
        self._checkpoints: dict[int, str] = {}
        self._landed: list[dict[str, Any]] = []  # eval-fleet results collected, not yet logged  # weight version -> the checkpoint holding it (eval results' key)
        self._closed = False

    # ------------------------------------------------------------------------- set-up

    def connect(self) -> None:
        """Start a local Ray or join `cluster.ray_address` (nothing when this process is connected
        already: that Ray is used and left running); `setup` calls it when not called before."""
        import ray

        if not ray.is_initialized():
            with keep_sigterm_handler():  # ray.init's own handler aborts: the caller's stays
                self.cluster = RayCluster.connect(self.config.cluster, num_cpus=self.num_cpus,
                                                  num_gpus=self.num_gpus)

    def _node_staged_fields(self) -> dict[str, str] | None:
        """The remote URLs of the staged train fields when train ranks run on other nodes than the driver (they
        stage those themselves); None when the driver's staged copies serve (or LoRA: driver-only)."""
        from slime.storage.staging import TRAIN_FIELDS

        if self.staging is None or not self.placement.remote_train or self.config.lora.lora_rank > 0:
            return None
        fields = {k: v for k, v in self.staging.fields.items() if k in TRAIN_FIELDS}
        return fields or None

    @unwrap_signal_errors
    def setup(self) -> dict[str, Any]:
        """Start Ray (or join it), the placement, the rollout manager and the train group; restore the
        data-source state of a resumed checkpoint; push the trainer's weights into the engines."""
        import ray

        from slime.backends.megatron.checkpoint import latest_checkpoint

        t0 = time.monotonic()
        c = self.config
        self.connect()
        self.placement = create_placement(c.cluster)
        remote_fields = self._node_staged_fields()
        check_across_nodes(c, self.placement, node_staging=bool(remote_fields))
        started: dict[str, Any] = {"router_url": None, "worker_urls": []}
        if not c.run.debug_train_only:  # slime's --debug-train-only: no engines
            self.manager = ray.remote(RolloutManager).options(**self.placement.manager_options()).remote(
                c.model_dump(mode="json"), self.placement.engine_devices(), self.log_dir,
                self.placement.engine_host_options(), gc_freeze=True)
            starts = [self.manager.start.remote()]
            if c.cluster.eval_num_gpus:  # its engines start beside the rollout engines
                self.eval_fleet = EvalFleet(c, self.placement.eval_fleet(), self.log_dir)
                starts.append(self.eval_fleet.start())
            started = ray.get(starts)[0]
        self.worker_urls = started["worker_urls"]
        self.num_rollout = self._resolve_num_rollout()
        if not c.run.debug_rollout_only:  # slime's --debug-rollout-only: no trainer
            self.train_group = TrainGroup(c, self.placement, remote_fields=remote_fields)
            self.start_rollout_id = self.train_group.init()
        resumed = self.start_rollout_id
        if c.data.start_rollout_id is not None:  # slime's --start-rollout-id: replaces the resumed checkpoint's
            self.start_rollout_id = c.data.start_rollout_id
        extra: dict[str, Any] = {}
        if self.start_rollout_id > 0:
            extra = self.train_group.extra_state() if self.train_group is not None else {}
            if "data_source" in extra and self.manager is not None:
                ray.get(self.manager.load_data_source_state.remote(extra["data_source"]))
            elif "slime_data_source" in extra and self.manager is not None:  # --load of a slime checkpoint
                ray.get(self.manager.load_slime_cursor.remote(extra["slime_data_source"]))
            else:
                logger.warning("resumed at rollout %d from a checkpoint without a data-source state: the prompts "
                               "start from the beginning of the data", self.start_rollout_id)
        # this run's own checkpoint (not another run's, given as --load) whose step died between its save and
        # its metrics line: finish that step below
        own = bool(c.checkpoint.save) and latest_checkpoint(c.checkpoint.save) is not None
        tail = self.start_rollout_id - 1 if own and self.start_rollout_id == resumed > 0 and \
            self.start_rollout_id - 1 not in read_metrics(self.metrics_uri, self.store.storage_options) else None
        moved = set_aside_stale_steps(self.store, c.run.run_id, self.start_rollout_id,  # outputs to redo
                                      redo_start_eval=tail is not None)
        debug = c.run.debug_rollout_only or c.run.debug_train_only  # one side only: nothing to sync
        check = c.run.check_weight_update_equal and not debug
        if check:  # slime: engines snapshot their (HF) weights and zero them; the first sync must restore them
            for action in ("snapshot", "reset_tensors"):
                ray.get(self.manager.check_weights.remote(action))
        # engines start from HF: align them (the eval fleet too: a before-train eval runs there)
        sync = {} if debug else self._update_weights(self.start_rollout_id, evals=self.eval_fleet is not None)
        start = (latest_checkpoint(c.checkpoint.save) if own else None) or c.checkpoint.load or c.checkpoint.hf_checkpoint
        self._checkpoints[self.start_rollout_id] = start  # what the weights of the first version came from
        if check:
            ray.get(self.manager.check_weights.remote("compare"))
            logger.info("--check-weight-update-equal: every engine's weights equal their snapshot after the sync")
        if c.cluster.release_train and self.train_group is not None:  # slime: no train ranks during rollouts
            self.train_group.release()
        elif self.offload_train and self.train_group is not None:
            self.train_group.offload()
        if self.fully_async:  # generation starts now, on the synced weights, with what the checkpoint held
            ray.get(self.manager.start_fully_async.remote(self.weight_version, self.start_rollout_id,
                                                          extra.get("fully_async")))
        tensorboard = None
        if c.run.use_tensorboard:
            tensorboard = c.run.tensorboard_dir or open_fs(
                self.store.uri(c.run.run_id, STAGE, "tensorboard"), self.store.storage_options)[1]
        self.metrics_log = MetricsLog(self.metrics_uri, self.store.storage_options, tensorboard,
                                      WandbLogger(c) if c.run.use_wandb else None)
        if tail is not None:
            self._finish_step(tail, extra.get("step_record"), sync)
        result = {"start_rollout_id": self.start_rollout_id, "num_rollout": self.num_rollout,
                  "resumed": self.start_rollout_id > 0, "stale_outputs_moved": len(moved),
                  "router_url": started["router_url"], "worker_urls": self.worker_urls,
                  "weight_version": self.weight_version, "initial_sync_s": sync.get("sync/total_s"),
                  "setup_s": time.monotonic() - t0}
        logger.info("rl set up in %.1f s: rollouts %d..%d, %s", result["setup_s"], self.start_rollout_id,
                    self.num_rollout - 1, {"off": "sync", "one_step_off": "async (one-step-off)",
                                           "fully": "fully async"}[c.sync.async_mode])
        return result

    def _finish_step(self, rollout_id: int, record: dict[str, Any] | None, sync: dict[str, Any]) -> None:
        """Finish step `rollout_id`, whose checkpoint was committed but whose run died before its metrics
        line: its eval (when due) on the checkpoint's weights, just synced, and the line, from the rollout
        and train metrics saved with the checkpoint. So no step of a resumed run is missing from the log."""
        if record is None:
            logger.warning("checkpoint of rollout %d has no step record (older format): its metrics line and eval "
                           "are not recovered", rollout_id)
            return
        logger.info("resumed after checkpoint %d, whose step was cut short: finishing its eval and metrics line",
                    rollout_id)
        self._steps[rollout_id] = {**record, **sync}
        self.maybe_eval(rollout_id)
        self.log_step(rollout_id)

    def _resolve_num_rollout(self) -> int:
        """`num_rollout`, or slime's `len(prompts) // rollout_batch_size * num_epoch`; written into the
        config the train group gets (its LR schedule length depends on it)."""
        import ray

        r = self.config.rollout
        if r.num_rollout is None:
            prompts = ray.get(self.manager.data_source_state.remote())["num_prompts"]
            r.num_rollout = prompts // r.rollout_batch_size * self.config.data.num_epoch
            logger.info("num_rollout = %d prompts // %d x %d epochs = %d", prompts, r.rollout_batch_size,
                        self.config.data.num_epoch, r.num_rollout)
        return r.num_rollout

    # ------------------------------------------------------------------------- steps

    def _launch(self, rollout_id: int) -> None:
        self._inflight[rollout_id] = (self.manager.generate.remote(rollout_id),
                                      self.manager.data_source_state.remote())

    def _collect(self, rollout_id: int) -> tuple[str, dict[str, Any]]:
        import ray

        if rollout_id in self._ready:
            return self._ready.pop(rollout_id)
        if rollout_id not in self._inflight:
            self._launch(rollout_id)
        generate, state = self._inflight.pop(rollout_id)
        self._states[rollout_id] = state
        return ray.get(generate)

    @unwrap_signal_errors
    def rollout(self, rollout_id: int) -> dict[str, Any]:
        """Generate rollout `rollout_id` (or collect it, launched by the previous step in async mode)
        into the store; async: launch the next one before returning."""
        import ray

        t0 = time.monotonic()
        if self.config.run.debug_train_only:
            uri, metrics = self._stored_rollout(rollout_id), {}
        elif self.fully_async:  # the finished groups of the generation that never stops
            uri, metrics = ray.get(self.manager.take_batch.remote(rollout_id))
        else:
            uri, metrics = self._collect(rollout_id)
        wait = time.monotonic() - t0
        if self.fully_async:
            metrics["perf/trainer_idle_s"] = wait  # the trainer waiting for finished groups
        if self.config.sync.async_mode == "one_step_off" and rollout_id + 1 < self.num_rollout:
            self._launch(rollout_id + 1)
        if self.offload_rollout and self.manager is not None:
            metrics.update(ray.get(self.manager.offload.remote()))
        metrics["perf/rollout_wait_s"] = wait
        self._step(rollout_id).update(metrics)
        return {"rollout_id": rollout_id, "uri": uri, "wait_s": wait, **headline(metrics)}

    def _stored_rollout(self, rollout_id: int) -> str:
        """--load-debug-rollout-data: the committed shard set its template names for `rollout_id`."""
        from slime.storage import is_committed

        uri = self.config.run.load_debug_rollout_data.format(rollout_id=rollout_id)
        if not is_committed(uri, self.store.storage_options):
            raise NotCommittedError(f"--load-debug-rollout-data: rollout {rollout_id}: {uri} is not a committed "
                                    "rollout shard set")
        return uri

    @unwrap_signal_errors
    def train(self, rollout_id: int, uri: str) -> dict[str, Any]:
        """Train on the shard set `uri`; the train group's global metrics."""
        if self.train_group is None:  # --debug-rollout-only
            return {"rollout_id": rollout_id, "trained": False}
        onload = None
        if self.train_group.released:  # --release-train: new ranks from the last rollout's checkpoint
            self.train_group.recreate(rollout_id)
        elif self.offload_train:
            t0 = time.monotonic()
            self.train_group.onload()
            onload = time.monotonic() - t0
        metrics = self.train_group.train(rollout_id, uri)
        if onload is not None:
            metrics["perf/onload_train_time"] = onload
        self._step(rollout_id).update(metrics)
        return {"rollout_id": rollout_id, **jsonable(metrics)}

    def sync_due(self, rollout_id: int) -> bool:
        if self.train_group is None or self.manager is None:  # a debug mode: one side only
            return False
        return (rollout_id + 1) % self.config.sync.update_weights_interval == 0 or self.eval_due(rollout_id)

    @unwrap_signal_errors
    def sync(self, rollout_id: int) -> dict[str, Any]:
        """Push the weights trained on `rollout_id` into the engines when due (weight_version id+1);
        with colocated offload, engines take their memory back first and train ranks release theirs after."""
        import ray

        metrics: dict[str, Any] = {}
        if self.offload_rollout and self.manager is not None:
            metrics.update(ray.get(self.manager.onload.remote()))
        synced = self.sync_due(rollout_id)
        evals = synced and self.eval_fleet is not None and self.eval_due(rollout_id)
        if evals:  # the fleet's weights change only between its evals: the previous one ends first
            lines, waited = self.eval_fleet.wait()
            self._landed += lines
            metrics["perf/eval_fleet_wait_s"] = waited
        if self.fully_async:
            if synced and not self._generation_paused:  # no request runs while the weights change
                metrics.update(ray.get(self.manager.pause_generation.remote())["metrics"])
                self._generation_paused = True
            if synced:
                metrics.update(self._update_weights(rollout_id + 1, evals=evals))
            if self._generation_paused:
                ray.get(self.manager.resume_generation.remote(self.weight_version))
                self._generation_paused = False
        elif synced:
            nxt = rollout_id + 1
            if nxt in self._inflight:  # async: never change weights under a running generation
                t0 = time.monotonic()
                generate, state = self._inflight.pop(nxt)
                self._states[nxt] = state
                self._ready[nxt] = ray.get(generate)
                metrics["perf/wait_inflight_rollout_s"] = time.monotonic() - t0
            metrics.update(self._update_weights(nxt))
        if self.config.cluster.release_train and self.train_group is not None:  # slime: ranks gone until train
            self.train_group.release()
        elif self.offload_train and self.train_group is not None:
            t0 = time.monotonic()
            self.train_group.offload()
            metrics["perf/offload_train_time"] = time.monotonic() - t0
        metrics["weight_version"] = self.weight_version
        self._step(rollout_id).update(metrics)
        return {"rollout_id": rollout_id, "synced": synced, "weight_version": self.weight_version,
                "sync_s": metrics.get("sync/total_s", 0.0)}

    def _update_weights(self, version: int, evals: bool = False) -> dict[str, Any]:
        """Sync every live engine (restarted ones awaiting weights included: fault tolerance); the rollout
        manager then lets those that report `version` serve again. `evals`: the eval fleet's engines too, in
        the same call (the trainer exports the weights once; distributed sync reconnects when the engine set
        changes)."""
        import ray

        self.worker_urls = ray.get(self.manager.begin_weight_update.remote())
        fleet = self.eval_fleet if evals else None
        eval_urls = fleet.begin_weight_update() if fleet is not None else []
        try:
            metrics = self.train_group.update_weights(self.worker_urls + eval_urls, str(version))
        except BaseException:
            with contextlib.suppress(Exception):
                ray.get(self.manager.end_weight_update.remote(None))
            if fleet is not None:
                with contextlib.suppress(Exception):
                    fleet.end_weight_update(None)
            raise
        metrics.update(ray.get(self.manager.end_weight_update.remote(str(version))))
        if fleet is not None:
            fleet.end_weight_update(version)
        self.weight_version = version
        return metrics

    def eval_due(self, rollout_id: int, before_train: bool = False) -> bool:
        if self.manager is None:  # --debug-train-only: no engines to evaluate with
            return False
        e = self.config.eval
        if before_train:
            return bool(e.eval_interval) and rollout_id == 0 and not e.skip_eval_before_train
        return _due(rollout_id, e.eval_interval, self.num_rollout)

    @unwrap_signal_errors
    def maybe_eval(self, rollout_id: int, before_train: bool = False) -> dict[str, Any]:
        """Evaluate the engines' current weights when due; stored as eval step `weight_version`, keyed in the
        metrics by rollout id, weight version and the checkpoint holding those weights (None: none saved).
        With an eval fleet the eval is launched there and this returns at once (`launched`); its result is
        logged when it ends (`log_step`)."""
        import ray

        version = self.weight_version
        if not self.eval_due(rollout_id, before_train) or version in self._evaluated:
            return {"rollout_id": rollout_id, "evaluated": False}
        self._evaluated.add(version)
        checkpoint = self._checkpoints.get(version)
        if self.eval_fleet is not None:
            self.eval_fleet.launch(rollout_id, version, checkpoint)
            return {"rollout_id": rollout_id, "evaluated": False, "launched": True, "weight_version": version}
        metrics = ray.get(self.manager.eval.remote(version))
        metrics.update({"eval/rollout_id": rollout_id, "eval/weight_version": version, "eval/checkpoint": checkpoint})
        self._step(rollout_id).update(metrics)
        return {"rollout_id": rollout_id, "evaluated": True, **jsonable(metrics)}

    def save_due(self, rollout_id: int) -> bool:
        if self.train_group is None:  # --debug-rollout-only: nothing trained
            return False
        ck = self.config.checkpoint
        return bool(ck.save) and (_due(rollout_id, ck.save_interval, self.num_rollout) or rollout_id + 1 == self.num_rollout
                                  or self.config.cluster.release_train)  # the recreated ranks resume from it

    @unwrap_signal_errors
    def maybe_save(self, rollout_id: int) -> dict[str, Any]:
        """When due, commit the train group's checkpoint `rollout_id` with the data-source state after
        its batch (cursor and partial-rollout buffer): a rerun resumes with the next batch."""
        import ray

        if not self.save_due(rollout_id):
            return {"rollout_id": rollout_id, "saved": False}
        t0 = time.monotonic()
        held: dict[str, Any] = {}
        if self.fully_async:  # paused until the sync: the groups held, consistent with the cursor
            paused = ray.get(self.manager.pause_generation.remote(snapshot=True))
            self._generation_paused = True
            held = dict(paused["state"])
            state = held.pop("data_source")  # kept once, as "data_source" below; setup restores it first
            held = {"fully_async": held}
            self._step(rollout_id).update(paused["metrics"])
        else:
            ref = self._states.get(rollout_id)  # none with --debug-train-only: no data source
            state = ray.get(ref) if ref is not None else {}
        # weight_version: of the saved weights (trained through this rollout), what a resumed run syncs
        # step_record: the step's rollout and train metrics, for a resume that must write its line
        extra = {"rollout_id": rollout_id, "data_source": state, "weight_version": rollout_id + 1,
                 "partial_rollout_buffer_groups": len(state.get("buffer", [])),
                 "step_record": jsonable(self._step(rollout_id)), **held}
        # --async-save: committed in the background, except the last save and one the released ranks resume from
        wait = rollout_id + 1 == self.num_rollout or self.config.cluster.release_train
        self.last_checkpoint = self.train_group.save(rollout_id, extra, wait=wait)
        self._checkpoints[rollout_id + 1] = self.last_checkpoint
        for old in [i for i in self._states if i < rollout_id]:
            del self._states[old]
        seconds = time.monotonic() - t0
        self._step(rollout_id).update({"perf/save_s": seconds})
        return {"rollout_id": rollout_id, "saved": True, "path": self.last_checkpoint, "save_s": seconds}

    @unwrap_signal_errors
    def log_step(self, rollout_id: int) -> dict[str, Any]:
        """Write the step's record (headline numbers first, then every scalar) and return it. Eval-fleet
        results that ended since the last step (all of them at the last step) come first, each a line of
        its own, listed under the returned record's "evals" (not written: a list)."""
        metrics = self._steps.pop(rollout_id, {})
        for old in [i for i in self._states if i < rollout_id]:  # a later save needs only its own state
            del self._states[old]
        if self.eval_fleet is not None:
            self._landed += self.eval_fleet.wait()[0] if rollout_id + 1 == self.num_rollout else self.eval_fleet.poll()
        landed, self._landed = self._landed, []
        for line in [x for x in landed if x["rollout_id"] == rollout_id]:  # ended within its own step
            landed.remove(line)
            metrics.update({k: v for k, v in line.items() if k not in ("rollout_id", "record", "time")})
        record = {"rollout_id": rollout_id, "time": time.time(), "weight_version": self.weight_version,
                  "async": self.config.sync.async_mode, **headline(metrics), **jsonable(metrics)}
        record = jsonable(record)
        evals = [jsonable(line) for line in landed]
        if self.metrics_log is not None:
            for line in evals:
                self.metrics_log.append(line)
            self.metrics_log.append(record)
        if evals:
            record["evals"] = evals
        logger.info("rollout %d: reward %.4f, ppo_kl %.3g, grad_norm %.4g, rollout %.1f s, train %.1f s, sync %.1f s",
                    rollout_id, record.get("rl/reward_mean", float("nan")), record.get("rl/ppo_kl", float("nan")),
                    record.get("rl/grad_norm", float("nan")), record.get("rl/rollout_s", 0.0),
                    record.get("rl/train_s", 0.0), record.get("rl/sync_s", 0.0))
        return record

    def _step(self, rollout_id: int) -> dict[str, Any]:
        return self._steps.setdefault(rollout_id, {})

    # ------------------------------------------------------------------------- shutdown

    def close(self) -> None:
        """Stop everything this loop started, in reverse order; each part even if another fails."""
        import ray

        if self._closed:
            return
        self._closed = True
        if self.metrics_log is not None:
            self.metrics_log.close()
        if self.train_group is not None:
            with contextlib.suppress(Exception):
                self.train_group.shutdown()
        if self.eval_fleet is not None:
            self.eval_fleet.dispose()
        if self.manager is not None:
            try:  # runs after any generate still queued in the actor; its engines need stopping
                ray.get(self.manager.dispose.remote(), timeout=CLOSE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - shutting down: report, go on
                logger.warning("rollout manager dispose failed (%s): engine processes may be left", exc)
            with contextlib.suppress(Exception):
                ray.kill(self.manager)
        if self.placement is not None:
            with contextlib.suppress(Exception):
                self.placement.remove()
        if self.cluster is not None:
            self.cluster.shutdown()
        self._inflight.clear()
        self._ready.clear()
        self._states.clear()
