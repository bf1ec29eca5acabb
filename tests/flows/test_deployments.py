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
    assert deployment["work_pool"]["name"] == "slime-local"


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
