"""Issue 16's resume promise, end to end: `python -m slime.rl` in fully async mode (partial rollout,
`--max-policy-version-lag 1`, a checkpoint every step) is SIGKILLed at three random moments and rerun each
time, then run to its end. Over the committed rollout shard sets of the run (what was trained) and its
dropped sets, every group of prompts drawn appears exactly once: trained once, dropped once, or still held
by the final checkpoint; none lost, none repeated; no trained sample is more than one version behind."""

from __future__ import annotations

import contextlib
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))  # rl_setup (plugins for the subprocess)

from rl_setup import rl_config  # noqa: E402
from test_sigkill_resume import (  # noqa: E402
    AGENTS,
    RUN_TIMEOUT_S,
    alive,
    describe,
    run_to_end,
    spawn,
    wait_gone,
)

from slime.backends.megatron.checkpoint import latest_checkpoint, read_training_state  # noqa: E402
from slime.storage import ArtifactStore, is_committed, read_samples  # noqa: E402

NUM_ROLLOUT = 12  # room for three kills even when steps take well under a second (an idle machine)
KILLS = 3


def write_config(tiny_kit, root: Path) -> tuple[Path, str, object]:
    config = rl_config(tiny_kit, root / "run", "fully-killed", actor_num_gpus_per_node=1, rollout_num_gpus=1)
    config.run.store = str(root / "store")
    config.rollout.num_rollout = NUM_ROLLOUT
    config.rollout.partial_rollout = True
    config.rollout.rollout_max_response_len = 24
    config.checkpoint.save_interval = 1
    config.sync.async_mode = "fully"
    config.sync.max_policy_version_lag = 1
    path = root / "fully.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path, config.checkpoint.save, config


def kill_after_next_checkpoint(config_file: Path, save: str, log: Path, rng: random.Random) -> int | None:
    """Start the run, wait for a checkpoint newer than the current one, wait a random 0-1 s more, SIGKILL
    it and everything it started; the newest checkpoint's step then (None: it finished first)."""
    before = latest_checkpoint(save)
    started: list[psutil.Process] = []
    ray_dirs: set[str] = set()
    child = spawn(config_file, log)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while latest_checkpoint(save) == before:
            if child.poll() is not None:
                assert child.returncode == 0, log.read_text()[-3000:]
                return None
            assert time.monotonic() < deadline, "no new checkpoint in time"
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 1.0))
        if child.poll() is not None:
            return None
        started = psutil.Process(child.pid).children(recursive=True)
        for proc in started:
            with contextlib.suppress(psutil.Error):
                ray_dirs |= set(re.findall(r"/tmp/slime-ray-[^/\s]+", " ".join(proc.cmdline())))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        left = wait_gone([p for p in started if not any(a in describe(p) for a in AGENTS)], 60)
        assert not left, [describe(p) for p in left]
    finally:
        if child.poll() is None:
            child.kill()
        for proc in started:  # only what this run started, by PID
            if alive(proc):
                proc.kill()
        for path in ray_dirs:
            shutil.rmtree(path, ignore_errors=True)
    newest = latest_checkpoint(save)
    return int(newest.rsplit("_", 1)[1]) if newest else None


@pytest.mark.slow
def test_sigkill_at_three_random_moments_trains_every_prompt_exactly_once(tiny_kit, tmp_path):
    config_file, save, config = write_config(tiny_kit, tmp_path)
    log = tmp_path / "run.log"
    rng = random.Random(16)
    killed_at = [kill_after_next_checkpoint(config_file, save, log, rng) for _ in range(KILLS)]
    assert all(k is not None and k < NUM_ROLLOUT - 1 for k in killed_at), killed_at  # each kill was mid-run
    result = run_to_end(config_file, log)
    assert result["resumed"] and result["start_rollout_id"] >= killed_at[-1] + 1

    store = ArtifactStore.from_config(config)
    run = config.run.run_id
    seen: list[int] = []
    for rollout_id in range(NUM_ROLLOUT):
        kept = read_samples(store.uri(run, "rollout", f"{rollout_id:06d}"))
        assert len(kept) == config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
        for s in kept:  # the bound held across every restart
            assert rollout_id - min(s.token_weight_versions) <= 1
        seen += sorted({s.group_index for s in kept})
        dropped = store.uri(run, "rollout_dropped", f"{rollout_id:06d}")
        if is_committed(dropped):
            seen += sorted({s.group_index for s in read_samples(dropped)})
    extra = read_training_state(result["last_checkpoint"]).extra_state
    held = extra["fully_async"]
    seen += [g[0]["group_index"] for g in held["completed"] + held["interrupted"] + held["dropped"]]
    assert len(seen) == len(set(seen)), "a group was trained or dropped twice"
    assert sorted(seen) == list(range(extra["data_source"]["sample_group_index"])), "a group was lost"
