"""prefect.yaml: every deployment names an importable flow, its parameters fit the flow's signature,
its config loads, and its work pool is one `make serve` (flows/serve.py) creates; runs start in the project
root. No Prefect API needed."""

import importlib
import os
import signal
import socket
from pathlib import Path

import pytest
import yaml
from prefect import Flow
from prefect.cli.deploy._models import DeploymentConfig

from flows import serve
from slime.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PROJECT = yaml.safe_load((ROOT / "prefect.yaml").read_text())
POOLS = set(serve.work_pools())  # what `make serve` creates: prefect.yaml's definitions.work_pools


def test_runs_start_in_the_project_root():
    (step,) = PROJECT["pull"]
    assert step["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $PWD }}"


@pytest.mark.parametrize("deployment", PROJECT["deployments"], ids=lambda d: d["name"])
def test_deployment_names_a_flow_that_takes_its_parameters(deployment):
    path, function = deployment["entrypoint"].split(":")
    assert (ROOT / path).is_file()
    flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), function)
    assert isinstance(flow, Flow)
    params = flow.validate_parameters(deployment.get("parameters", {}))  # raises on unknown or mistyped ones
    assert (ROOT / params["config"]).is_file()
    assert load_config(ROOT / params["config"]).run.store
    assert deployment["work_pool"]["name"] in POOLS  # `make serve` creates it before `prefect deploy --all`
    # prefect deploy reads it (the pool's `description`, for `make serve`, is a key it ignores)
    assert DeploymentConfig.model_validate(deployment).work_pool.name == deployment["work_pool"]["name"]


def test_make_serve_creates_every_pool_and_serves_the_local_one():
    """flows/serve.py reads the pools from prefect.yaml (nothing to keep in step by hand); each has a description
    saying where its worker runs."""
    named = {d["work_pool"]["name"] for d in PROJECT["deployments"]}
    assert named <= POOLS and serve.LOCAL_POOL in named
    assert set(serve.deployments_by_pool()) == named
    for name, pool in serve.work_pools().items():
        assert pool["description"], name
    assert "make serve" in serve.work_pools()[serve.LOCAL_POOL]["description"]
    assert "make serve" in (ROOT / "Makefile").read_text() and "python -m flows.serve" in (ROOT / "Makefile").read_text()


def test_a_signal_while_a_child_starts_is_raised_after_it():
    """SIGINT between fork and `worker = Popen(...)` must not lose the worker: it is raised once the block ends."""
    previous = {sig: signal.signal(sig, serve._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        reached_end = False
        with pytest.raises(serve.Stopped) as stopped, serve.starting_child():
            os.kill(os.getpid(), signal.SIGINT)
            reached_end = True
        assert reached_end and stopped.value.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # the shutdown is not cut short by a second one
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_port_in_use_is_refused_but_not_one_a_stopped_server_left():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(SystemExit, match="is in use"):
            serve.check_port_free(sock.getsockname()[1])
    # the server side closes first, so its end of the connection stays in TIME_WAIT (as after `make serve`
    # stopped); the server started right after binds with SO_REUSEADDR, so the check must let it
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()
    server.close()
    client.recv(1)  # the server's FIN arrived
    client.close()
    serve.check_port_free(port)


def test_work_pools_set_only_the_process_workers_job_variables():
    """slime-gpu (a worker on the Ray head node) and slime-cpu (export, small evals): their job variables are
    ones Prefect's process worker template defines, so `prefect deploy` accepts them."""
    from prefect.workers.process import ProcessWorker

    known = set(ProcessWorker.get_default_base_job_template()["variables"]["properties"])
    pools = serve.work_pools()
    assert set(pools) == {"slime-local", "slime-gpu", "slime-cpu"}
    for name, pool in pools.items():
        assert set(pool.get("job_variables", {})) <= known, name
    assert pools["slime-cpu"]["job_variables"]["env"]["CUDA_VISIBLE_DEVICES"] == ""
    names = {d["name"]: d for d in PROJECT["deployments"]}
    multinode = load_config(ROOT / names["multinode-gpu"]["parameters"]["config"])
    assert multinode.cluster.ray_address and multinode.engine.engine_host == "0.0.0.0"
    assert names["multinode-gpu"]["work_pool"]["name"] == "slime-gpu"
    assert names["export-cpu"]["work_pool"]["name"] == "slime-cpu"


def test_pipeline_deployment_is_post_training_tiny_cpu():
    names = {d["name"]: d for d in PROJECT["deployments"]}
    from flows.pipeline import pipeline

    assert names["tiny-cpu"]["entrypoint"] == "flows/pipeline.py:pipeline" and pipeline.name == "post-training"


def test_scheduled_eval_watches_a_run_on_cron_and_gpu_deployment_uses_sglang():
    names = {d["name"]: d for d in PROJECT["deployments"]}
    watch = names["evaluate-newest"]
    assert watch["parameters"]["eval_watch_run"] and watch["schedules"][0]["cron"].count(" ") == 4
    gpu = load_config(ROOT / names["qwen2.5-0.5b-gpu"]["parameters"]["config"])
    assert gpu.engine.engine == "sglang" and gpu.cluster.colocate
