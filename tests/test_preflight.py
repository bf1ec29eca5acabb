"""slime.preflight: the config's kit built when missing, outputs placed under {store}/{run_id}, input paths
checked; and, slow, the newcomer's path: a fresh checkout without `make run` runs `slime pipeline`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime.config import load_config
from slime.errors import ConfigError, InputNotFoundError
from slime.preflight import check_device, check_inputs, ensure_kit, place_outputs, prepare_run

ROOT = Path(__file__).resolve().parents[1]
TEST_RECIPE = ROOT / "tests" / "tiny_kit_recipe.yaml"


def kit_config(tmp_path: Path, recipe_text: str, kit: str = "kits/mine") -> Path:
    """A config (in tmp_path/conf) naming a kit by relative paths, and its model and data inside the kit."""
    conf = tmp_path / "conf"
    conf.mkdir(exist_ok=True)
    (conf / "recipe.yaml").write_text(recipe_text)
    path = conf / "c.yaml"
    path.write_text(f"run:\n  store: {tmp_path / 'store'}\n  run_id: r\n"
                    f"kit:\n  kit_recipe: recipe.yaml\n  kit_dir: ../{kit}\n"
                    f"checkpoint:\n  hf_checkpoint: ../{kit}/model\n"
                    f"data:\n  prompt_data: ../{kit}/data/train.jsonl@[0:8]\n"
                    f"sft:\n  sft_data: ../{kit}/data/sft.jsonl\n"
                    f"eval:\n  eval_prompt_data:\n    held: ../{kit}/data/eval.jsonl\n")
    return path


def test_a_missing_kit_is_built_from_the_configs_recipe_then_reused(tmp_path):
    path = kit_config(tmp_path, TEST_RECIPE.read_text())
    config = load_config(path)
    assert config.kit.kit_dir == str(tmp_path / "kits" / "mine")  # relative to the config file's directory
    assert config.checkpoint.hf_checkpoint == str(tmp_path / "kits" / "mine" / "model")
    with pytest.raises(InputNotFoundError, match=r"checkpoint.hf_checkpoint \(set at .*c.yaml:8\)"):
        check_inputs(config)  # before the kit is built
    prepared = prepare_run(config)
    manifest = tmp_path / "kits" / "mine" / "kit.json"
    built = json.loads(manifest.read_text())
    assert built["recipe"]["model"]["hidden_size"] == 128  # the test recipe's, not the default kit's 256
    assert prepared.checkpoint.hf_checkpoint == config.checkpoint.hf_checkpoint
    stamp = manifest.stat().st_mtime_ns
    ensure_kit(config)  # present: checked against its manifest, not rebuilt
    assert manifest.stat().st_mtime_ns == stamp


def test_any_recipe_serves_the_same_way(tmp_path):
    """Not the tiny kit only: another recipe (other data task sizes and model shape) named by a config."""
    recipe = TEST_RECIPE.read_text().replace("hidden_size: 128", "hidden_size: 64").replace(
        "num_train: 2000", "num_train: 50")
    prepare_run(load_config(kit_config(tmp_path, recipe, kit="kits/other")))
    built = json.loads((tmp_path / "kits" / "other" / "kit.json").read_text())
    assert built["recipe"]["model"]["hidden_size"] == 64 and built["recipe"]["data"]["num_train"] == 50
    assert len((tmp_path / "kits" / "other" / "data" / "train.jsonl").read_text().splitlines()) == 50


def test_relative_paths_on_the_command_line_stay_relative_to_the_working_directory(tmp_path):
    path = kit_config(tmp_path, TEST_RECIPE.read_text())
    config = load_config(path, ["--prompt-data", "mine.jsonl"])
    assert config.data.prompt_data == "mine.jsonl" and config.source("data.prompt_data") == "--prompt-data"
    assert config.sft.sft_data == str(tmp_path / "kits" / "mine" / "data" / "sft.jsonl")


def test_outputs_go_under_the_run_directory(tmp_path):
    store = tmp_path / "store"
    config = load_config(None, ["--store", str(store), "--run-id", "r", "--save-hf", "hf", "--output-dir",
                                "/abs/out"])
    placed = place_outputs(config, "rl")
    assert placed.checkpoint.save == str(store / "r" / "rl" / "checkpoint")  # the stage's default
    assert placed.checkpoint.save_hf == str(store / "r" / "hf")  # relative: under the run
    assert placed.export.output_dir == "/abs/out"  # absolute: the user's choice
    assert place_outputs(config, "export").export.output_dir == "/abs/out"
    assert place_outputs(load_config(None, ["--store", str(store), "--run-id", "r"]), "export").export.output_dir \
        == str(store / "r" / "export" / "hf")
    assert place_outputs(config, "sft").checkpoint.save == str(store / "r" / "sft" / "checkpoint")
    assert place_outputs(load_config(None, ["--save", "x"]), "rl").checkpoint.save == "x"  # no run id: as given
    assert placed.source("checkpoint.save_hf") == "--save-hf"  # where fields were set survives the copy


def test_remote_inputs_are_left_to_the_stage_and_file_urls_are_checked(tmp_path):
    check_inputs(load_config(None, ["--prompt-data", "s3://bucket/train.jsonl", "--hf-checkpoint", "gs://b/m"]))
    with pytest.raises(InputNotFoundError, match=f"data.prompt_data .*{tmp_path}/p.jsonl does not exist"):
        check_inputs(load_config(None, ["--prompt-data", f"file://{tmp_path}/p.jsonl"]))


@pytest.mark.slow
def test_a_fresh_checkout_runs_the_pipeline_without_make(tmp_path):
    """`slime pipeline --config deployments/tiny-cpu.yaml --run-id x` in a checkout where nothing was built:
    the kit is built from the config's recipe (here the test suite's small one in its place), every stage
    runs, and everything the run writes is under runs/x. Shortened with flags: 1 SFT epoch on 64
    conversations, 1 RL step of 2 prompts, 8 eval prompts."""
    clone = tmp_path / "clone"
    (clone / "deployments").mkdir(parents=True)
    (clone / "datasets" / "tiny").mkdir(parents=True)
    shutil.copy(ROOT / "deployments" / "tiny-cpu.yaml", clone / "deployments" / "tiny-cpu.yaml")
    shutil.copy(TEST_RECIPE, clone / "datasets" / "tiny" / "recipe.yaml")
    # as a user types it (no make, so no Prefect settings of the Makefile), with a Prefect home of its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(tmp_path / "prefect-home"), DO_NOT_TRACK="1")
    flags = ["--sft-num-epoch", "1", "--sft-data", "runs/tiny-kit/data/sft.jsonl@[0:64]",
             "--rs-prompt-data", "runs/tiny-kit/data/train.jsonl@[0:2]", "--num-rollout", "1",
             "--rollout-batch-size", "2", "--global-batch-size", "16", "--micro-batch-size", "8",
             "--eval-prompt-data", "arithmetic", "runs/tiny-kit/data/eval.jsonl@[0:8]"]
    done = subprocess.run([sys.executable, "-m", "slime", "pipeline", "--config", "deployments/tiny-cpu.yaml",
                           "--run-id", "x", *flags], cwd=clone, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    kit = json.loads((clone / "runs" / "tiny-kit" / "kit.json").read_text())
    assert kit["recipe"]["model"]["hidden_size"] == 128  # built from the checkout's recipe, on demand
    assert sorted(p.name for p in (clone / "runs").iterdir()) == ["tiny-kit", "x"]
    stages = {p.name for p in (clone / "runs" / "x").iterdir() if not p.name.startswith(".")}
    assert {"convert", "sft", "rejection_sampling", "rl", "evaluate", "export"} <= stages
    assert (clone / "runs" / "x" / "rl" / "checkpoint" / "iter_0000000" / "manifest.json").is_file()
    assert (clone / "runs" / "x" / "rl" / "logs" / "router.log").is_file()  # engine logs with the run
    assert (clone / "runs" / "x" / ".prefect-results").is_dir()
    assert not (clone / "runs" / "x" / ".lease.json").exists()  # released
    assert sorted(p.name for p in clone.iterdir()) == ["datasets", "deployments", "runs"]
    assert "exported HF model" in done.stdout


def _gpu_config(tmp_path: Path, extra: str = "") -> Path:
    """The test kit's config plus Megatron in bf16 (as deployments/gpu-small.yaml asks), on this CPU machine."""
    path = kit_config(tmp_path, TEST_RECIPE.read_text())
    path.write_text(path.read_text() + "megatron:\n  bf16: true\n" + extra)
    return path


def test_a_gpu_configuration_without_cuda_is_refused_before_the_kit_is_built(tmp_path, monkeypatch):
    """gpu-small.yaml on the CPU build of torch trained its SFT at ~40 s a step (585 steps), unannounced."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = load_config(_gpu_config(tmp_path))
    for stage in (None, "sft", "rl", "rejection_sampling", "evaluate"):
        with pytest.raises(ConfigError, match=r"megatron.bf16 is set \(set at .*c.yaml:\d+\): this is a GPU "
                                              r"configuration, but torch .* TORCH_SPEC=\"torch==2.14.1\""):
            prepare_run(config, stage)
    assert not (tmp_path / "kits" / "mine").exists()  # refused before the kit was built
    prepare_run(config, "convert")  # conversion and export read and write checkpoints on the host
    prepare_run(config, needs_device=False)
    assert (tmp_path / "kits" / "mine" / "kit.json").exists()


def test_a_cluster_elsewhere_or_an_fp32_config_is_not_checked_here(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    remote = load_config(_gpu_config(tmp_path, "cluster:\n  ray_address: 10.0.0.1:6379\n"))
    check_device(remote)  # the driver may sit on a CPU head node of a GPU cluster
    check_device(load_config(kit_config(tmp_path, TEST_RECIPE.read_text())))  # the CPU default: fp32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_device(load_config(_gpu_config(tmp_path)))  # a GPU machine
