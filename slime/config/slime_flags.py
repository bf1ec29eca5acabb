"""slime's own command-line flags and what this project does with each, so a slime launch script works here.

`slime_flags.tsv` lists every flag THUDM/slime's `slime/utils/arguments.py` defines itself (not Megatron's
nor SGLang's own), with slime's type, default and help, at the commit named in its header. Each flag ends
in one of three states:

* accepted: a config field of the same name with slime's meaning (`slime config reference` lists it), or
  a Megatron flag the `megatron:` pass-through takes;
* mapped: accepted, but this project does the job its own way (`MAPPED` says how; `load_config` logs it
  once when the flag is set);
* refused: `REFUSED` gives the one-line reason, naming what is missing; `load_config` raises a
  `ConfigError` naming the flag instead of ignoring it.

`DEFAULTS_DIFFER` lists the accepted flags whose default here is not slime's, and why.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).with_name("slime_flags.tsv")


@dataclass(frozen=True)
class SlimeFlag:
    """One row of `slime_flags.tsv`: a flag as slime declares it."""

    flag: str  # --rollout-batch-size
    dest: str  # slime's args attribute (differs from the flag for its store_false --disable-* flags)
    type: str  # int, float, str, bool, json.loads
    default: str  # slime's default, as Python source
    action: str
    nargs: str
    choices: str  # comma-separated
    group: str  # slime's add_<group>_arguments
    declared_by: str  # add_argument, or reset_arg (a Megatron flag slime re-declares or re-defaults)
    help: str

    @property
    def name(self) -> str:
        """The flag as a config field name: `--rollout-batch-size` -> rollout_batch_size."""
        return self.flag[2:].replace("-", "_")


@functools.cache
def slime_flags() -> tuple[SlimeFlag, ...]:
    """Every row of `slime_flags.tsv`, in slime's order."""
    lines = [line for line in TABLE.read_text().splitlines() if line and not line.startswith("#")]
    rows = list(csv.reader(lines[1:], delimiter="\t", quoting=csv.QUOTE_NONE))
    return tuple(SlimeFlag(*row) for row in rows)


def source_commit() -> str:
    """The THUDM/slime commit the table was read from (its header names it)."""
    for line in TABLE.read_text().splitlines():
        if "at commit " in line:
            return line.split("at commit ", 1)[1].split()[0]
    raise ValueError(f"{TABLE}: header names no commit")


# flag (as a field name) -> why this project refuses it: what is missing
REFUSED: dict[str, str] = {
    "qwen_gdn_backend": "Qwen gated-delta-net (linear attention) layers are not built here",
    "custom_model_provider_path": "models are built by mbridge from the HF config; a custom provider is not built "
                                  "here",
    "freeze_indexer": "DSA indexer layers are not built here",
    "allgather_cp": "context parallelism is not built here",
    "multimodal_keys": "multimodal prompts are not built here (text and chat messages only)",
    "load_forge_rollout_data": "replaying dumped .pt rollouts is not built here (rollouts are Arrow shard sets)",
    "use_distributed_post": "distributed HTTP posting through Ray is not built here",
    "megatron_deepgemm_forward_layers": "DeepGEMM block-FP8 forward layers are not built here",
    "megatron_deepgemm_forward_modules": "DeepGEMM block-FP8 forward layers are not built here",
    "megatron_deepgemm_moe_forward_layers": "DeepGEMM block-FP8 forward layers are not built here",
    "megatron_deepgemm_moe_forward_modules": "DeepGEMM block-FP8 forward layers are not built here",
    "mtp_num_layers": "multi-token prediction (MTP) layers are not built here",
    "mtp_loss_scaling_factor": "multi-token prediction (MTP) layers are not built here",
    "enable_mtp_training": "multi-token prediction (MTP) layers are not built here",
}

# slime's flags of its SGLang launcher (slime/backends/sglang_utils/arguments.py, same commit; not in slime_flags.tsv)
# that are neither `--sglang-<ServerArgs flag>` pass-through nor config fields here -> why refused. (Its
# --sglang-config is refused by the pass-through check: sglang_server.RESERVED_SGLANG_ARGS["config"].)
LAUNCHER_REFUSED: dict[str, str] = {
    "prefill_num_servers": "prefill/decode disaggregation is not built here: each engine prefills and decodes its "
                           "own requests; for throughput add engines (--rollout-num-gpus)",
}

# slime's flags of its SGLang launcher that set an option of the router it starts -> (sglang-router option, why);
# they reach the `sglang` pass-through by their prefix, and load_config moves them to `router` (logged)
LAUNCHER_ROUTER: dict[str, tuple[str, str]] = {
    "sglang_router_request_timeout_secs": (
        "request_timeout_secs", "slime sets the router's RouterArgs.request_timeout_secs with it; given nowhere, "
        "the router here keeps sglang-router's default, 1800 s (slime's: 14400 s)"),
}

_RAY_START = ("an option of the scripts' `ray start` line, not of slime's train.py: `slime rl` starts a local Ray "
              "itself, or joins a running cluster given by --ray-address")
# options of the `ray start` / `ray job submit` / `ray stop` lines of slime's scripts (all 68 scripts/*.sh at the
# commit above), not of train.py: they stay unknown options, and the message says what does their job here
RAY_CLI: dict[str, str] = {
    **{name: _RAY_START for name in ("head", "node_ip_address", "num_gpus", "disable_usage_stats", "dashboard_host",
                                     "dashboard_port")},
    "force": "an option of the scripts' `ray stop` line, not of slime's train.py: `slime rl` stops the Ray it started",
    "address": "an option of the scripts' `ray job submit` line, not of slime's train.py: to join a running Ray "
               "cluster give --ray-address",
    "runtime_env_json": "an option of the scripts' `ray job submit` line, not of slime's train.py: the train ranks' "
                        "environment variables (its env_vars) are --train-env-vars, as JSON",
}

# flag -> how this project does the job (accepted; logged once when set)
MAPPED: dict[str, str] = {
    "save_debug_rollout_data": "every rollout is committed to the store as an Arrow shard set "
                               "({store}/{run_id}/rollout/NNNNNN, read with `slime shards inspect`); no .pt dump "
                               "is written",
    "save_debug_train_data": "the trainer's input is the committed rollout shard set, kept in the store; the "
                             "trainer's per-step tensors are recomputed from it; no .pt dump is written",
    "debug_rollout_only": "debug modes are ways of running the RL stage here: it generates rollouts (and evals) "
                          "into the store as committed shard sets, with no trainer, save or weight sync (the "
                          "engines keep the HF weights)",
    "debug_train_only": "debug modes are ways of running the RL stage here: it trains on stored rollout shard sets "
                        "(--load-debug-rollout-data) with no engines, so no weight sync or eval",
    "load_debug_rollout_data": "slime's .pt dumps are the store's rollout shard sets here: a URI template with "
                               "{rollout_id} (e.g. runs/RUN/rollout/{rollout_id:06d}) of committed shard sets, "
                               "trained on in place of generating (implies --debug-train-only)",
    "dump_details": "the store keeps what slime's detail dump holds: every rollout shard set "
                    "({store}/{run_id}/rollout/), checkpoint, eval shard set and metrics.jsonl line; no separate "
                    "dump is written",
    "rollout_data_transport": "rollout data reaches the trainer as an Arrow shard set in the store, not through "
                              "Ray's object store",
    "num_gpus_per_node": "the engines' and train ranks' GPUs come from Ray's placement groups over the GPUs each "
                         "node reports (docs/ray.md), so a node with fewer than 8 GPUs needs no flag; the value has "
                         "no effect",
    "model_name": "the Megatron <-> HF weight converter is chosen by mbridge from the HF config's architecture "
                  "(checkpoint.hf_checkpoint); the value has no effect",
}

_BUFFER_PLUGIN = ("slime's own code never reads it; its rollout-buffer example plugin does: the value reaches plugins "
                  "as args.{name}, as in slime")
# accepted flag that slime's own code never reads (624b824a): only plugins and examples do, on `args`; so here it
# is a config field plugins find on `as_namespace()`, and setting it is logged once with this note
PLUGIN_ONLY: dict[str, str] = {
    "rollout_buffer_url": _BUFFER_PLUGIN.format(name="rollout_buffer_url"),
    "fetch_trajectory_retry_times": _BUFFER_PLUGIN.format(name="fetch_trajectory_retry_times"),
    "rollout_task_type": _BUFFER_PLUGIN.format(name="rollout_task_type"),
    "min_batch_collection_ratio": "slime declares it and never reads it: accepted for launch scripts, without "
                                  "effect, as in slime; plugins see args.min_batch_collection_ratio",
    "http_proxy": "slime declares it and never reads it: accepted for launch scripts, without effect, as in "
                  "slime; plugins see args.http_proxy",
}

# accepted flag -> why its default here is not slime's
DEFAULTS_DIFFER: dict[str, str] = {
    "actor_num_gpus_per_node": "1: the embedded default runs on one device (slime: 8)",
    "input_key": "'prompt': slime's own data format ({\"prompt\": ..., \"label\": ...}) loads unchanged "
                 "(slime: 'input')",
    "label_key": "'label': as input_key (slime: None)",
    "rollout_function_path": "this project's rollout (slime.rollout.generate_rollout) has slime's signature",
    "disable_rewards_normalization": "a plain flag: slime stores its negation (rewards_normalization)",
    "disable_grpo_std_normalization": "a plain flag: slime stores its negation (grpo_std_normalization)",
    "disable_wandb_random_suffix": "a plain flag: slime stores its negation (wandb_random_suffix)",
    "data_pad_size_multiplier": "1: micro-batches here are right-padded rows, not one packed sequence, so "
                                "rounding each row up to 128 tokens would multiply short rows' cost (slime: 128)",
    "disable_compute_advantages_and_returns": "a plain flag: slime stores its negation "
                                              "(compute_advantages_and_returns)",
    "disable_rollout_global_dataset": "a plain flag: slime stores its negation (rollout_global_dataset)",
    "data_source_path": "this project's RolloutDataSource (slime: its RolloutDataSourceWithBuffer); a class "
                        "written to slime's interface works the same",
    "loss_mask_type": "None: SFT masks come from the chat template's {% generation %} marks (the kits' templates); "
                      "slime: qwen, which is here too",
    "update_weight_transport": "None: --weight-sync-mode auto picks (tensor when colocated, distributed "
                               "otherwise); slime: nccl",
}


def refusal(name: str) -> str | None:
    """Why the slime flag `name` (field spelling, one of its own or of its SGLang launcher) is refused here; None
    when it is not."""
    return REFUSED.get(name) or LAUNCHER_REFUSED.get(name)
