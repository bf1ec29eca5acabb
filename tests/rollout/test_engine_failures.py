"""Engines dying under a rollout, on a cluster of this module's own (the tests kill its engines, in
file order: one engine mid-rollout, then the other)."""

from __future__ import annotations

import functools
import threading
import time

import pytest
from conftest import args_for, engine_requests

from slime.data.prompts import load_prompts
from slime.data.source import RolloutDataSource
from slime.engines.client import EngineClient
from slime.rollout import RolloutEngineError, generate_rollout
from slime.types import Status


@pytest.fixture
def doomed_args(tiny_kit, doomed_cluster):
    """`make_args` for this module's cluster."""
    return lambda **fields: args_for(doomed_cluster[0], tiny_kit, **fields)


def test_engine_killed_mid_rollout_requests_move_to_the_live_engine(doomed_args, tiny_kit, doomed_cluster):
    """Requests on a killed engine are retried on the live one (sglang-router retries them; the client
    would retry a 5xx too), so the step still completes, balanced, and abort skips the dead engine."""
    router, engines = doomed_cluster
    args = doomed_args(rollout_batch_size=4, over_sampling_batch_size=6, sglang_server_concurrency=4,
                     rollout_max_response_len=40, custom_rm_path="rollout_plugins.rm_one")
    data_source = RolloutDataSource(load_prompts(str(tiny_kit.train)), n_samples_per_prompt=2, args=args)
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=generate_rollout(args, 0, data_source)))
    runner.start()
    deadline = time.monotonic() + 60
    while engine_requests(engines)[1] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    engines[1][0].stop(timeout_s=0)
    runner.join(timeout=240)
    assert not runner.is_alive()
    m = result["out"].metrics
    assert len(result["out"].samples) == 4
    assert m["rollout/groups/drawn"] == sum(
        m[f"rollout/groups/{k}"] for k in ("kept", "filtered", "failed", "aborted_dropped", "to_buffer"))
    failed = [s for g in result["out"].samples for s in g if s.status is Status.FAILED]
    assert failed == []
    assert engine_requests(engines[:1]) == [0]


def test_no_live_engine_fails_samples_then_raises(doomed_args, tiny_kit, doomed_cluster, monkeypatch):
    """Both engines dead: the router answers 5xx for every /generate; after the client's retries each
    sample is FAILED with the status in its error, and once a step's worth of groups failed in a row the
    rollout raises instead of drawing prompts forever. (10 ms between the client's retries instead of 0.5, 1,
    2 s: every engine is down for good here, and the test counts attempts, not seconds.)"""
    monkeypatch.setattr(EngineClient, "__init__", functools.partialmethod(EngineClient.__init__, backoff_base_s=0.01,
                                                                          backoff_max_s=0.01))
    router, engines = doomed_cluster
    for process, _ in engines:
        process.stop(timeout_s=0)
    deadline = time.monotonic() + 30
    while any(w["is_healthy"] for w in router.list_workers()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    args = doomed_args(rollout_batch_size=2, custom_rm_path="rollout_plugins.rm_one")
    data_source = RolloutDataSource(load_prompts(str(tiny_kit.train)), n_samples_per_prompt=2, args=args)
    with pytest.raises(RolloutEngineError, match=r"2 groups in a row failed \(kept 0/2\); first error: sample \d+: "
                                                 r"EngineHTTPError: POST .*/generate returned HTTP 5\d\d after 4"):
        generate_rollout(args, 0, data_source)
