"""prefect.yaml: every deployment names an importable flow, its parameters fit the flow's signature,
its config loads, and runs go to the local process pool in the project root (no Prefect API needed)."""

import importlib
from pathlib import Path

import pytest
import yaml
from prefect import Flow

from slime.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PROJECT = yaml.safe_load((ROOT / "prefect.yaml").read_text())
POOLS = {"slime-local", "slime-gpu", "slime-cpu"}


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
    assert load_config(ROOT / params["config"]).run.store
    assert deployment["work_pool"]["name"] in POOLS


def test_work_pools_set_only_the_process_workers_job_variables():
    """slime-gpu (a worker on the Ray head node) and slime-cpu (export, small evals): their job variables are
    ones Prefect's process worker template defines, so `prefect deploy` accepts them."""
    from prefect.workers.process import ProcessWorker

    known = set(ProcessWorker.get_default_base_job_template()["variables"]["properties"])
    pools = {d["work_pool"]["name"]: d["work_pool"] for d in PROJECT["deployments"]}
    assert set(pools) == POOLS
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
