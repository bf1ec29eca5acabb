"""Before anything starts (Ray, engines, a Prefect task): make a run's inputs and outputs ready, or fail in one
line that names the config field, the path and where the field was set.

`prepare_run(config, stage)` is called by every entry point right after the config is loaded (`slime <stage>`,
the flows, so also `slime pipeline` and the deployments). In order:

0. a GPU configuration (Megatron in bf16 or fp16) on a machine where torch sees no CUDA device is refused, before
   anything is built: on the CPU build of torch it would run, hours slower and unannounced (gpu-small's SFT at
   ~40 s a step on two cores). Conversion and export need no GPU, nor a run on a Ray cluster elsewhere
   (`cluster.ray_address`), whose driver may sit on a CPU head node;
1. the generated kit (`kit.kit_recipe` built into `kit.kit_dir`, slime/data/tiny.py) is built when that
   directory holds none, so a fresh clone runs without a separate set-up command;
2. outputs are placed under `{store}/{run_id}`: a relative `checkpoint.save`, `checkpoint.save_hf` or
   `export.output_dir` is taken relative to the run directory, and a stage's own output defaults to
   `{store}/{run_id}/<stage>/checkpoint` (export: `{store}/{run_id}/export/hf`), where the flows write it;
3. every local input path in the config (model, tokenizer, prompt, SFT and eval data, eval config) must
   exist: `InputNotFoundError` otherwise. Remote URLs (s3://...) are left to the stage that reads them,
   once their protocol is known to be one fsspec has.
"""

from __future__ import annotations

import os
from typing import Any

from slime.config import INPUT_PATH_FIELDS, Config
from slime.data.prompts import parse_data_path
from slime.data.tiny import load_recipe, make_tiny_kit
from slime.errors import ConfigError, DataFormatError, InputNotFoundError
from slime.storage import ArtifactStore
from slime.storage.fs import join_uri, unknown_protocol

# a stage's own output when the config names none: field, artifact name under {store}/{run_id}/<stage>/
STAGE_OUTPUTS = {"convert": ("checkpoint.save", "checkpoint"), "sft": ("checkpoint.save", "checkpoint"),
                 "rl": ("checkpoint.save", "checkpoint"), "export": ("export.output_dir", "hf")}
OUTPUT_PATH_FIELDS = ("checkpoint.save", "checkpoint.save_hf", "export.output_dir")
HF_FIELDS = ("checkpoint.hf_checkpoint", "export.origin_hf_dir")  # HF model directories
DATA_FIELDS = ("data.prompt_data", "sft.sft_data", "rejection_sampling.rs_prompt_data", "eval.eval_prompt_data")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HOST_STAGES = ("convert", "export")  # checkpoint reading and writing: no accelerator needed
GPU_PRECISIONS = ("bf16", "fp16")  # megatron options a CPU run never asks for


def prepare_run(config: Config, stage: str | None = None, *, needs_device: bool = True) -> Config:
    """The device checked, the kit built, outputs placed for `stage` (None: only relative outputs are placed),
    inputs checked. `needs_device` False: the caller converts or exports only (as `stage` convert/export say)."""
    if needs_device and stage not in HOST_STAGES:
        check_device(config)
    ensure_kit(config)
    config = place_outputs(config, stage)
    check_inputs(config)
    return config


def check_device(config: Config) -> None:
    """ConfigError when the config asks for a GPU run (megatron bf16/fp16) on a local cluster and torch sees no CUDA
    device, naming the field, where it was set, and the torch build."""
    wanted = [name for name in GPU_PRECISIONS if config.megatron.get(name)]
    if not wanted or config.cluster.ray_address:
        return
    import torch  # heavy; the stage imports it next anyway

    if torch.cuda.is_available():
        return
    build = (f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None
             else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA device or driver")
    field = f"megatron.{wanted[0]}"
    raise ConfigError(f"{field} is set{_set_at(config, field)}: this is a GPU configuration, but {build}. Install the "
                      "CUDA build on a GPU machine (README.md, 'On your GPUs': make install TORCH_SPEC=\"torch==2.14.1\" "
                      "EXTRAS=\"test,gpu\"), or on CPU run deployments/tiny-cpu.yaml; convert and export run without "
                      "a GPU, and a run on a Ray cluster elsewhere (cluster.ray_address) is not checked here")


def _get(config: Config, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


def _set(config: Config, values: dict[str, Any]) -> Config:
    """A copy with `section.field` values replaced (the copy keeps where each field was set)."""
    sections: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        section, name = dotted.split(".")
        sections.setdefault(section, {})[name] = value
    update = {s: getattr(config, s).model_copy(update=fields) for s, fields in sections.items()}
    return config.model_copy(update=update)


def _set_at(config: Config, dotted: str) -> str:
    where = config.source(dotted) or config.source(dotted.split(".")[0])
    return f" (set at {where})" if where else ""


def ensure_kit(config: Config) -> None:
    """Build the config's kit into `kit.kit_dir` unless it holds that kit already (checked by its manifest)."""
    recipe, kit_dir = config.kit.kit_recipe, config.kit.kit_dir
    if recipe is None and kit_dir is None:
        return
    if recipe is None or kit_dir is None:
        given, missing = ("kit.kit_recipe", "kit.kit_dir") if kit_dir is None else ("kit.kit_dir", "kit.kit_recipe")
        raise ConfigError(f"{given}{_set_at(config, given)} needs {missing} too: a kit is a recipe and the "
                          "directory it is built in")
    if "://" in kit_dir:
        raise ConfigError(f"kit.kit_dir{_set_at(config, 'kit.kit_dir')}: {kit_dir} must be a local directory")
    make_tiny_kit(os.path.expanduser(kit_dir), load_recipe(os.path.expanduser(recipe)))


def place_outputs(config: Config, stage: str | None) -> Config:
    """Relative output paths under `{store}/{run_id}`, and `stage`'s own output there when unset; without a
    run id the config is returned as it is (relative paths then mean the working directory)."""
    run_id = config.run.run_id
    if run_id is None:
        return config
    run_dir = ArtifactStore.from_config(config).uri(run_id)
    values = {}
    for dotted in OUTPUT_PATH_FIELDS:
        value = _get(config, dotted)
        if value and "://" not in value and not os.path.isabs(os.path.expanduser(value)):
            values[dotted] = join_uri(run_dir, os.path.normpath(value))
    if stage in STAGE_OUTPUTS:
        dotted, name = STAGE_OUTPUTS[stage]
        if _get(config, dotted) is None:
            values[dotted] = join_uri(run_dir, stage, name)
    return _set(config, values) if values else config


def check_inputs(config: Config) -> None:
    """Every local input path named in the config exists (HF directories: with their config and tokenizer)."""
    for dotted in INPUT_PATH_FIELDS:
        value = _get(config, dotted)
        if value is None:
            continue
        named = value.items() if isinstance(value, dict) else [(None, value)]
        for key, path in named:
            field = dotted if key is None else f"{dotted}.{key}"
            _check_path(config, dotted, field, path)


def _check_path(config: Config, dotted: str, field: str, value: str) -> None:
    if (protocol := unknown_protocol(value)) is not None:
        raise ConfigError(f"{field}{_set_at(config, dotted)}: unknown storage protocol {protocol!r} in {value!r}: "
                          "use a local path or an fsspec URL (s3://bucket/prefix, gs://..., memory://...)")
    if "://" in value and not value.startswith("file://"):
        return
    path = value.removeprefix("file://")
    if dotted in DATA_FIELDS:
        try:
            path, _ = parse_data_path(path)
        except DataFormatError as exc:
            raise ConfigError(f"{field}{_set_at(config, dotted)}: {exc}") from None
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise InputNotFoundError(f"{field}{_set_at(config, dotted)}: {path} does not exist{_hint(config, dotted)}")
    if dotted in HF_FIELDS:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise InputNotFoundError(f"{field}{_set_at(config, dotted)}: {path} is not an HF model directory (no "
                                     "config.json in it)")
        if dotted == "checkpoint.hf_checkpoint" and not any(os.path.isfile(os.path.join(path, name))
                                                            for name in TOKENIZER_FILES):
            raise InputNotFoundError(f"{field}{_set_at(config, dotted)}: {path} has no tokenizer (none of "
                                     f"{', '.join(TOKENIZER_FILES)}); save the tokenizer into the model directory")


def _hint(config: Config, dotted: str) -> str:
    source = config.source(dotted) or ""
    relative = ("relative paths on the command line resolve against the working directory" if source.startswith("--")
                else "relative paths in a config file resolve against the file's directory")
    if dotted == "checkpoint.hf_checkpoint":
        return ("; it must be a local HF model directory (a hub model: huggingface-cli download ORG/NAME "
                "--local-dir DIR; a generated kit: name it under `kit:` in the config, or build it with slime "
                f"datasets make-tiny DIR --recipe RECIPE); {relative}")
    return f"; {relative}"
