"""The one typed configuration tree: YAML file, then `--flag value` overrides, validated once.

Layout. The YAML file is nested by section (`rollout:`, `algorithm:`, ...); every field name is
unique across sections and keeps slime's flag name, so `--rollout-batch-size 8` on the command line
sets `rollout.rollout_batch_size`, exactly as a slime user would write it. Three sections are
pass-through dicts instead of typed fields:

* `sglang`: every `--sglang-<flag>` (SGLang `ServerArgs`), forwarded verbatim to the engines;
* `router`: every `--router-<flag>` (sglang-router), forwarded to the router;
* `megatron`: Megatron flags that slime does not model itself (`--tensor-model-parallel-size 2`),
  checked against megatron-core's config dataclasses when an unknown flag is seen; the model's own
  (`TransformerConfig`) options reach the model through `bridge.model_options`. Megatron-LM's `--no-X`
  fusion flags are stored as the option they set False (`slime/config/megatron_flags.py`).

Errors name the file and line (YAML) or the flag (CLI) that is wrong. `section_hash` gives a stable
content hash of any section, which the orchestration layer uses as a cache key.

Modules, each importing only those above it here (and nothing of slime above `slime.config`):

* `base`: the section base class, the signature of a check;
* `run`, `checkpoint`, `rollout`, `training`, `lora`, `stages`, `sync`: the sections, each group with the checks
  that concern it;
* `tree`: `Config`, the whole tree, and the index of flat field names;
* `passthrough`: the checks of the `sglang`, `router` and `megatron` sections, `megatron_flag_names`;
* `overrides`: parsing `--flag value` command-line overrides;
* `validate`: the cross-field checks in their order, run once at load;
* `loader`: `load_config` (YAML with line numbers, overrides, input paths, --megatron-config-path).
"""

from slime.config.checkpoint import CheckpointConfig
from slime.config.loader import (
    INPUT_PATH_FIELDS,
    load_config,
    read_megatron_role_config,
    resolve_input_path,
)
from slime.config.lora import LORA_HF_TO_MEGATRON, LORA_MEGATRON_TARGETS, LoraConfig, lora_megatron_targets
from slime.config.overrides import _FLAG_ALIASES, _NEGATABLE, _field_kind, parse_overrides
from slime.config.passthrough import megatron_flag_names
from slime.config.rollout import DataConfig, EngineConfig, EvalConfig, RewardConfig, RolloutConfig
from slime.config.run import DEFAULT_GPU_FRACTION, RUN_ID_PATTERN, ClusterConfig, KitConfig, RunConfig
from slime.config.stages import ExportConfig, RejectionSamplingConfig
from slime.config.sync import SyncConfig, check_async_mode
from slime.config.training import AdvantageEstimator, AlgorithmConfig, SftConfig, TrainConfig
from slime.config.tree import (
    _PASS_THROUGH,
    _TYPED_SECTIONS,
    FIELD_SECTION,
    Config,
    read_custom_config,
    stable_hash,
)

__all__ = [
    "DEFAULT_GPU_FRACTION",
    "FIELD_SECTION",
    "INPUT_PATH_FIELDS",
    "LORA_HF_TO_MEGATRON",
    "LORA_MEGATRON_TARGETS",
    "RUN_ID_PATTERN",
    "_FLAG_ALIASES",
    "_NEGATABLE",
    "_PASS_THROUGH",
    "_TYPED_SECTIONS",
    "AdvantageEstimator",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "ExportConfig",
    "KitConfig",
    "LoraConfig",
    "RejectionSamplingConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SftConfig",
    "SyncConfig",
    "TrainConfig",
    "_field_kind",
    "check_async_mode",
    "load_config",
    "lora_megatron_targets",
    "megatron_flag_names",
    "parse_overrides",
    "read_custom_config",
    "read_megatron_role_config",
    "resolve_input_path",
    "stable_hash",
]
