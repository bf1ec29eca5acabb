"""Engine fault tolerance (`engine.use_fault_tolerance`): the health monitor's decisions, and a rollout
manager (run in this process: no Ray needed for its engines) whose engine 1 is SIGKILLed, in file order:
mid-rollout (the step completes; the engine comes back on a new port and serves again after the next
weight sync), while idle with disk-mode weights at hand (re-synced by the manager itself), and once more
past the restart limit (it stays down; rollouts go on with engine 0). Then fully async generation (a manager
of its own): an engine restarted mid-generation is part of the weight update and of the next pause's aborts.
Last, LoRA adapter sync (a manager of its own): a killed engine comes back with the adapter from the sync dir."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from rl_setup import rl_config
from safetensors.torch import load_file
from transformers import AutoConfig

from slime.config import SyncConfig, load_config
from slime.engines.health import FailureTracker
from slime.errors import ConfigError
from slime.ray.rollout_manager import RolloutManager
from slime.storage import read_samples
from slime.sync import WeightSyncer
from slime.types import Status

BATCH, GROUP, INTERVAL_S = 4, 4, 0.5


def test_failure_tracker_restarts_after_the_threshold_and_gives_up_past_the_limit():
    tracker = FailureTracker(failure_threshold=2, max_restarts=1)
    assert [tracker.record(0, ok) for ok in (False, True, False)] == ["wait", "ok", "wait"]
    assert tracker.record(0, False) == "restart"  # two failures in a row
    assert tracker.record(1, False) == "wait"  # engines are counted apart
    assert [tracker.record(0, False) for _ in range(2)] == ["wait", "give_up"]  # one restart allowed
    with pytest.raises(ValueError, match="failure_threshold"):
        FailureTracker(failure_threshold=0, max_restarts=1)


def test_fault_tolerance_settings_are_validated():
    config = load_config(None, ["--use-fault-tolerance", "--rollout-health-check-failures", "3"])
    assert config.engine.use_fault_tolerance and config.engine.rollout_health_check_failures == 3
    with pytest.raises(ConfigError, match="rollout-health-check-interval"):
        load_config(None, ["--rollout-health-check-interval", "0"])


# ----------------------------------------------------------------------------- a manager with a dying engine


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ft-weights")


@pytest.fixture(scope="module")
def manager(tiny_kit, tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    config = rl_config(tiny_kit, root, "ft", actor_num_gpus_per_node=1, rollout_num_gpus=2)
    config.rollout.rollout_batch_size, config.rollout.n_samples_per_prompt = BATCH, GROUP
    config.rollout.rollout_max_response_len, config.rollout.sglang_server_concurrency = 48, 4
    config.engine.use_fault_tolerance = True
    config.engine.rollout_health_check_interval = INTERVAL_S
    config.engine.rollout_health_check_timeout = 10.0
    config.engine.rollout_max_engine_restarts = 2
    config.sync.weight_sync_mode = "disk"  # update_weight_disk_dir unset: re-synced by the next sync
    yield from _started(RolloutManager(config.model_dump(mode="json"), [[], []], str(root / "logs")))


def _started(mgr: RolloutManager):
    """Start `mgr`'s engines for a fixture; afterwards every engine process it ran must be gone."""
    try:
        mgr.start()
        yield mgr
    finally:
        pids = [e["pid"] for e in mgr.engines()]
        mgr.dispose()
        assert not any(_alive(pid) for pid in pids if pid)


@pytest.fixture(scope="module")
def policy(tiny_kit, weights_dir):
    """The trainer's side: weights unlike the HF checkpoint (MLPs doubled), synced in disk mode."""
    weights = {name: t * 2 if "mlp" in name else t for name, t in
               load_file(str(Path(tiny_kit.model_dir) / "model.safetensors")).items()}
    syncer = WeightSyncer(SyncConfig(weight_sync_mode="disk", update_weight_disk_dir=str(weights_dir)),
                          hf_config=AutoConfig.from_pretrained(tiny_kit.model_dir))

    def sync(mgr: RolloutManager, version: str) -> tuple[list[str], dict]:
        """What RLLoop._update_weights does around the trainer's sync."""
        urls = mgr.begin_weight_update()
        asyncio.run(syncer.sync(urls, lambda: iter(weights.items()), version))
        return urls, mgr.end_weight_update(version)

    return sync


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_state(mgr: RolloutManager, index: int, state: str, restarts: int, timeout_s: float = 180.0) -> dict:
    """Engine `index`'s info once it is in `state` after `restarts` restarts."""
    deadline = time.monotonic() + timeout_s
    while (engine := mgr.engines()[index])["state"] != state or engine["restarts"] != restarts:
        assert time.monotonic() < deadline, f"engine {index} still {engine}"
        time.sleep(0.2)
    return engine


def _get(url: str) -> dict:
    with httpx.Client(timeout=30, trust_env=False) as http:
        return http.get(url).json()


def _generated_tokens(url: str) -> int:
    return _get(f"{url}/server_info")["internal_states"][0]["generated_tokens"]


def _greedy(url: str) -> tuple[list[int], list[float]]:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0.0, "max_new_tokens": 8},
            "return_logprob": True}
    with httpx.Client(timeout=60, trust_env=False) as http:
        meta = http.post(f"{url}/generate", json=body).json()["meta_info"]
    return [p[1] for p in meta["output_token_logprobs"]], [p[0] for p in meta["output_token_logprobs"]]


def _kill_when_busy(url: str, pid: int) -> threading.Thread:
    """SIGKILL `pid` as soon as the engine at `url` holds a request (a thread; join it)."""

    def run() -> None:
        deadline = time.monotonic() + 120
        while _get(f"{url}/get_load")[0]["num_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_engine_killed_mid_rollout_comes_back_after_the_next_sync(manager, policy):
    assert policy(manager, "1")[1] == {"rollout/engines_reregistered": 0}
    before = manager.engines()
    assert [e["state"] for e in before] == ["serving", "serving"]
    killer = _kill_when_busy(before[1]["url"], before[1]["pid"])
    uri, step0 = manager.generate(0)
    killer.join(timeout=5)
    assert not killer.is_alive() and not _alive(before[1]["pid"])

    # the step completed on the surviving engine: every sample, none failed
    samples = read_samples(uri)
    assert len(samples) == BATCH * GROUP and step0["rollout/groups/failed"] == 0
    assert all(s.status is not Status.FAILED and s.weight_versions[-1] == "1" for s in samples)

    # restarted on a fresh port, but held out of the router until it has the fleet's weights
    restarted = _wait_state(manager, 1, "awaiting_sync", restarts=1)
    assert restarted["pid"] != before[1]["pid"] and restarted["url"] != before[1]["url"]
    assert _get(f"{restarted['url']}/model_info")["weight_version"] == "default"
    assert manager.worker_urls() == [before[0]["url"]] == manager.router.worker_urls()

    urls, result = policy(manager, "2")  # the trainer's next sync includes it
    assert urls == [before[0]["url"], restarted["url"]] and result == {"rollout/engines_reregistered": 1}
    assert [e["state"] for e in manager.engines()] == ["serving", "serving"]
    assert sorted(manager.router.worker_urls(healthy_only=True)) == sorted(urls)
    assert [_get(f"{u}/model_info")["weight_version"] for u in urls] == ["2", "2"]
    assert _greedy(urls[1]) == _greedy(urls[0])  # the same weights, not the HF checkpoint it started from

    # the next step uses both engines: each one's own generated-token counter grows by far more than
    # the one token per health check it also generates while idle
    tokens = [_generated_tokens(u) for u in urls]
    t0 = time.monotonic()
    uri, step1 = manager.generate(1)
    probes = (time.monotonic() - t0) / INTERVAL_S + 2
    grown = [_generated_tokens(u) - n for u, n in zip(urls, tokens, strict=True)]
    assert all(g > probes + 10 for g in grown), (grown, probes)
    assert len(read_samples(uri)) == BATCH * GROUP and step1["rollout/engines_serving"] == 2
    assert step0["rollout/engine_restarts"] + step1["rollout/engine_restarts"] == 1


def test_engine_killed_while_idle_is_resynced_from_disk_weights(manager, weights_dir):
    manager.config.sync.update_weight_disk_dir = str(weights_dir)  # the disk sync's directory: version 2 is there
    before = manager.engines()[1]
    os.kill(before["pid"], signal.SIGKILL)
    engine = _wait_state(manager, 1, "serving", restarts=2)
    assert engine["url"] != before["url"] and engine["pid"] != before["pid"]
    assert _get(f"{engine['url']}/model_info")["weight_version"] == "2"
    assert _greedy(engine["url"]) == _greedy(manager.engines()[0]["url"])
    assert sorted(manager.router.worker_urls(healthy_only=True)) == sorted(e["url"] for e in manager.engines())


def test_engine_dead_while_offloaded_past_the_restart_limit_stays_down(manager):
    before = manager.engines()[1]
    manager.offload()  # health checks pause while the engines' memory is released
    os.kill(before["pid"], signal.SIGKILL)
    time.sleep(INTERVAL_S * 3)
    assert manager.engines()[1]["state"] == "serving"  # not checked while offloaded
    manager.onload()  # reaches engine 0; the dead one is left to the monitor, which checks again
    _wait_state(manager, 1, "failed", restarts=2, timeout_s=60)
    assert manager.router.worker_urls() == [manager.engines()[0]["url"]] and not _alive(before["pid"])
    manager.args.rollout_max_response_len = 8  # only that the step runs on one engine matters here
    uri, metrics = manager.generate(2)
    assert len(read_samples(uri)) == BATCH * GROUP and metrics["rollout/engines_serving"] == 1


# ----------------------------------------------------------------------------- fully async generation


@pytest.fixture
def async_manager(tiny_kit, tmp_path):
    """A manager as `--async-mode fully` runs it: fault tolerance on, disk sync without a known directory (a
    restarted engine waits for the trainer's next sync)."""
    config = rl_config(tiny_kit, tmp_path, "ft-async", actor_num_gpus_per_node=1, rollout_num_gpus=2)
    config.rollout.rollout_batch_size, config.rollout.n_samples_per_prompt = BATCH, GROUP
    config.rollout.rollout_max_response_len, config.rollout.sglang_server_concurrency = 48, 4
    config.rollout.partial_rollout = True
    config.sync.async_mode = "fully"
    config.engine.use_fault_tolerance = True
    config.engine.rollout_health_check_interval = INTERVAL_S
    config.engine.rollout_health_check_timeout = 10.0
    config.sync.weight_sync_mode = "disk"
    yield from _started(RolloutManager(config.model_dump(mode="json"), [[], []], str(tmp_path / "logs")))


def test_fully_async_pause_aborts_an_engine_restarted_on_a_new_port(async_manager, policy, monkeypatch):
    """The generator runs all the time; engine 1 dies mid-generation and comes back on a new port, the weight
    update (paused generation, as RLLoop.sync) includes and registers it, and the next pause's aborts reach
    it at its new URL: it is left holding no request."""
    from slime.rollout import state as rollout_state

    mgr = async_manager
    policy(mgr, "1")
    mgr.start_fully_async(1, 1, None)
    before = mgr.engines()
    killer = _kill_when_busy(before[1]["url"], before[1]["pid"])
    uri, metrics = mgr.take_batch(1)  # finished on engine 0 (the router and client retry)
    killer.join(timeout=5)
    assert not killer.is_alive() and len(read_samples(uri)) == BATCH * GROUP
    restarted = _wait_state(mgr, 1, "awaiting_sync", restarts=1)
    assert restarted["url"] != before[1]["url"]

    mgr.pause_generation()  # RLLoop.sync: pause, update every live engine, resume
    urls, result = policy(mgr, "2")
    assert urls == [before[0]["url"], restarted["url"]] and result == {"rollout/engines_reregistered": 1}
    mgr.resume_generation(2)
    # The health monitor's /health_generate is a one-token request the engine counts in num_reqs (as SGLang
    # does) when it finds the engine idle: stopped here, so that num_reqs counts the generator's requests only.
    mgr.monitor.pause()
    deadline = time.monotonic() + 120
    while _get(f"{restarted['url']}/get_load")[0]["num_reqs"] == 0:  # the generator sends it work
        assert time.monotonic() < deadline, "the restarted engine got no request"
        time.sleep(0.02)

    aborted: list[str] = []
    abort_all = rollout_state.abort_all

    async def spy(client, urls):
        aborted.extend(urls)
        return await abort_all(client, urls)

    monkeypatch.setattr(rollout_state, "abort_all", spy)
    mgr.pause_generation()
    assert restarted["url"] in aborted and before[1]["url"] not in aborted
    assert _get(f"{restarted['url']}/get_load")[0]["num_reqs"] == 0
    mgr.monitor.resume()
    mgr.resume_generation(2)
    uri, metrics = mgr.take_batch(2)
    assert len(read_samples(uri)) == BATCH * GROUP and metrics["rollout/engines_serving"] == 2


# ----------------------------------------------------------------------------- the whole RL loop


@pytest.mark.slow
def test_rl_loop_step_survives_an_engine_kill_and_the_next_step_uses_both(tiny_kit, tmp_path):
    """Kill one engine mid-rollout in `RLLoop` (Ray, a Megatron rank, distributed sync over gloo): the
    step completes, the engine comes back, the loop's sync gives it the trainer's weights (a new
    weight-sync group: its URL changed) and the next step generates on both, matching the trainer."""
    import ray

    from slime.rl import RLLoop

    config = rl_config(tiny_kit, tmp_path, "ft-loop", actor_num_gpus_per_node=1, rollout_num_gpus=2)
    config.rollout.rollout_batch_size, config.rollout.n_samples_per_prompt = BATCH, GROUP
    config.rollout.rollout_max_response_len, config.rollout.sglang_server_concurrency = 48, 4
    config.rollout.num_rollout = 2
    config.train.global_batch_size = BATCH * GROUP
    config.engine.use_fault_tolerance = True
    config.engine.rollout_health_check_interval = INTERVAL_S
    loop = RLLoop(config, num_gpus=0)
    try:
        loop.setup()
        before = ray.get(loop.manager.engines.remote())
        killer = _kill_when_busy(before[1]["url"], before[1]["pid"])
        uri = loop.rollout(0)["uri"]
        killer.join(timeout=5)
        assert not killer.is_alive() and not _alive(before[1]["pid"])
        assert len(read_samples(uri)) == BATCH * GROUP
        loop.train(0, uri)
        deadline = time.monotonic() + 180
        while (engine := ray.get(loop.manager.engines.remote())[1])["state"] != "awaiting_sync":
            assert time.monotonic() < deadline, engine
            time.sleep(0.5)
        assert loop.sync(0)["weight_version"] == 1
        engines = ray.get(loop.manager.engines.remote())
        assert [e["state"] for e in engines] == ["serving", "serving"] and engines[1]["url"] != before[1]["url"]
        urls = [e["url"] for e in engines]
        assert [_get(f"{u}/model_info")["weight_version"] for u in urls] == ["1", "1"]
        step0 = loop.log_step(0)

        tokens = [_generated_tokens(u) for u in urls]
        rollout = loop.rollout(1)
        assert all(_generated_tokens(u) - n > 20 for u, n in zip(urls, tokens, strict=True))
        loop.train(1, rollout["uri"])
        step1 = loop.log_step(1)
        assert step0["rollout/engine_restarts"] + step1["rollout/engine_restarts"] == 1
        assert step1["rollout/engines_serving"] == 2 and step0["rollout/engines_reregistered"] == 1
        assert step1["rl/logprob_abs_diff"] < 1e-4  # both engines sampled with the trainer's weights
    finally:
        loop.close()


def test_lora_adapter_sync_engine_killed_is_given_the_adapter_from_disk(tiny_kit, tmp_path):
    """`--lora-sync adapter`: the fleet launches the engines with SGLang's LoRA flags, a sync loads the adapter,
    and an engine killed while idle comes back with that adapter (and version) from the sync directory."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from slime.sync.adapter import ADAPTER_NAME

    config = rl_config(tiny_kit, tmp_path, "ft-lora", actor_num_gpus_per_node=1, rollout_num_gpus=2)
    config.engine.use_fault_tolerance, config.engine.rollout_health_check_interval = True, INTERVAL_S
    config.lora.lora_rank, config.lora.lora_alpha = 4, 8
    config.sync.lora_sync, config.sync.update_weight_disk_dir = "adapter", str(tmp_path / "adapters")
    torch.manual_seed(0)  # a trained-looking adapter (B non-zero), written by peft as the trainer would
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"],
                                     base_model_name_or_path=str(tiny_kit.model_dir)))
    syncer = WeightSyncer(config.sync, hf_config=AutoConfig.from_pretrained(tiny_kit.model_dir),
                          write_adapter=lambda state, out: peft.save_pretrained(out, state_dict=state))
    mgr = RolloutManager(config.model_dump(mode="json"), [[], []], str(tmp_path / "logs"))
    try:
        mgr.start()
        base = _greedy(mgr.engines()[0]["url"])
        urls = mgr.begin_weight_update()
        asyncio.run(syncer.sync(urls, lambda: iter(get_peft_model_state_dict(peft).items()), "1"))
        mgr.end_weight_update("1")
        assert mgr.args.engine_lora_name == ADAPTER_NAME, "rollout requests name the adapter from now on"
        adapted = _greedy(mgr.engines()[0]["url"])
        assert adapted != base
        before = mgr.engines()[1]
        os.kill(before["pid"], signal.SIGKILL)
        engine = _wait_state(mgr, 1, "serving", restarts=1)
        assert engine["url"] != before["url"]
        assert _get(f"{engine['url']}/model_info")["weight_version"] == "1"
        assert _get(f"{engine['url']}/server_info")["internal_states"][0]["lora_adapters"] == [ADAPTER_NAME]
        assert _greedy(engine["url"]) == adapted
    finally:
        pids = [e["pid"] for e in mgr.engines()]
        mgr.dispose()
        assert not any(_alive(pid) for pid in pids if pid)
