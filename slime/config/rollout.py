"""Generation: prompt data (`data:`), rollout batches and plugins (`rollout:`), rewards (`reward:`), evaluation
(`eval:`), the inference engines (`engine:`), and the checks that concern them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from slime.config.base import ConfigTree, Fail, _Section
from slime.config.engine_flags import DTYPES, external_engine_urls, request_timeout_s
from slime.errors import ConfigError


class DataConfig(_Section):
    """Prompt data (JSONL or Parquet at any fsspec URL; `path@[a:b]` slices)."""

    prompt_data: str | None = None
    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = "metadata"
    tool_key: str | None = "tools"
    apply_chat_template: bool = Field(False, description="render input_key's chat messages with the tokenizer's "
                                                          "chat template")
    apply_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword "
                                                       "arguments of apply_chat_template (enable_thinking, ...)")
    rollout_shuffle: bool = False
    rollout_max_prompt_len: int | None = Field(None, ge=1)
    num_epoch: int | None = Field(None, ge=1, description="sets num_rollout from the data size when unset")
    disable_rollout_global_dataset: bool = Field(False, description="no prompt data: the rollout gets groups of "
                                                                    "empty samples with fresh ids and a custom "
                                                                    "rollout function makes the prompts")
    data_source_path: str = Field("slime.data.source.RolloutDataSource", description="data-source class, built as "
                                  "cls(args), with slime's get_samples(num_samples), add_samples(groups), __len__ "
                                  "(slime/data/source.py)")
    start_rollout_id: int | None = Field(None, ge=0, description="`slime rl`: first rollout id; None: the resumed "
                                                                 "checkpoint's next, else 0")


class RolloutConfig(_Section):
    """Generation: batch shape, sampling parameters and the rollout plugins."""

    rollout_batch_size: int | None = Field(None, ge=1, description="prompts (groups) per rollout step")
    n_samples_per_prompt: int = Field(1, ge=1)
    over_sampling_batch_size: int | None = Field(None, ge=1, description="groups submitted at once")
    num_rollout: int | None = Field(None, ge=0, description="RL steps; 0 means evaluation only")
    rollout_temperature: float = Field(1.0, gt=0)
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    rollout_top_k: int = -1
    rollout_max_response_len: int | None = Field(None, ge=1)
    rollout_max_context_len: int | None = Field(
        None, ge=2, description="prompt + response tokens of a rollout sample: each request asks for at most "
        "min(max_new_tokens, this - prompt tokens), and a prompt that leaves no room gives a TRUNCATED sample "
        "without a request; rollout_max_prompt_len defaults to this - 1 and eval_max_context_len to this (slime)")
    rollout_stop: list[str] | None = None
    rollout_stop_token_ids: list[int] | None = None
    rollout_skip_special_tokens: bool = False
    rollout_seed: int = 42
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    sglang_server_concurrency: int = Field(512, ge=1, description="in-flight requests per engine")
    rollout_http_timeout_s: float | None = Field(
        None, gt=0, description="read timeout of a generate request (rollout, eval, rejection sampling): a "
        "non-streaming /generate is silent until the response is done, so this bounds a generation. None (slime's "
        "client): no limit here; the router bounds every request (--sglang-router-request-timeout-secs, else "
        "sglang-router's 1800 s, per attempt, and it retries a timed-out one) and its error fails the sample. "
        "Refused below the router's request timeout: a cut here is not retried and leaves the engine generating; "
        "to bound generations lower the router's")
    rollout_function_path: str = "slime.rollout.generate_rollout"
    custom_generate_function_path: str | None = None
    dynamic_sampling_filter_path: str | None = None
    buffer_filter_path: str | None = None
    rollout_sample_filter_path: str | None = None
    rollout_all_samples_process_path: str | None = None
    rollout_sample_hook_path: list[str] = Field(default_factory=list, description="hook(args, sample, *, rollout_id, "
                                                "evaluation) -> Sample or None on each generated sample before its "
                                                "reward; sync or async; repeat the flag for several")
    custom_rollout_log_function_path: str | None = Field(None, description="log(rollout_id, args, samples, "
                                                         "rollout_extra_metrics, rollout_time) -> bool; true: the "
                                                         "step's default rollout/* metrics are not logged")
    custom_eval_rollout_log_function_path: str | None = Field(None, description="log(rollout_id, args, data, "
                                                              "extra_metrics) -> bool; true: the default eval/* "
                                                              "metrics are not logged")
    eval_function_path: str | None = Field(None, description="rollout function for eval, called with evaluation="
                                                             "True; None: rollout_function_path")
    rollout_data_transport: Literal["object-store", "nixl"] = Field(
        "object-store", description="mapped: rollout data reaches the trainer as an Arrow shard set in the store")
    # slime's rollout-buffer settings: its own code never reads them, its rollout-buffer example plugin does
    rollout_buffer_url: str | None = Field(None, description="for plugins (args.rollout_buffer_url): the rollout "
                                                             "buffer server's URL")
    fetch_trajectory_retry_times: int = Field(-1, description="for plugins: fetch retries, -1 unlimited")
    min_batch_collection_ratio: float = Field(1, description="for plugins: share of a batch to collect")
    rollout_task_type: str = Field("math", description="for plugins: the rollout buffer's task type")


class RewardConfig(_Section):
    """How responses are scored."""

    rm_type: str | None = Field(None, description="built-in reward (math, math_verify, dapo, deepscaler, f1, gpqa, ...)")
    rm_url: str | None = Field(None, description="endpoint for rm_type remote_rm")
    custom_rm_path: str | None = None
    group_rm: bool = False
    reward_key: str | None = Field(None, description="entry of a dict reward to train on")
    grading_processes: int | None = Field(
        None, ge=1, description="child processes that grade sympy/math-verify answers in parallel, each call with "
                                "its time limit (None: half the CPU cores, at most 8)")
    custom_reward_post_process_path: str | None = Field(None, description="fn(args, samples) -> (raw_rewards, "
                                                          "rewards) instead of the group normalisation "
                                                          "(slime/backends/megatron/hooks.py)")
    custom_convert_samples_to_train_data_path: str | None = Field(
        None, description="fn(args, samples) -> slime's train_data dict (rewards, loss_masks, ...): replaces the "
                          "trainer's reward normalisation and loss masks (slime/ray/train_actor.py)")


class EvalConfig(_Section):
    """Periodic and stand-alone evaluation."""

    eval_interval: int | None = Field(None, ge=1, description="`slime rl`: evaluate every N rollouts and after "
                                                              "the last; None: no periodic eval")
    eval_prompt_data: dict[str, str] | None = Field(None, description="dataset name -> path")
    eval_config: str | None = Field(None, description="YAML with per-dataset eval settings")
    skip_eval_before_train: bool = False
    n_samples_per_eval_prompt: int = Field(1, ge=1)
    eval_temperature: float | None = Field(None, ge=0, description="None: rollout_temperature")
    eval_top_p: float | None = Field(None, gt=0, le=1, description="None: rollout_top_p")
    eval_top_k: int | None = Field(None, description="None: rollout_top_k")
    eval_max_response_len: int | None = Field(None, ge=1, description="None: rollout_max_response_len")
    eval_input_key: str | None = None
    eval_label_key: str | None = None
    eval_tool_key: str | None = Field(None, description="eval prompts' tools key; None: tool_key")
    eval_reward_key: str | None = Field(None, description="entry of a dict reward that eval reports; None: "
                                                          "reward_key")
    eval_max_context_len: int | None = Field(None, ge=1, description="rollout_max_context_len for eval samples; "
                                                                     "None: rollout_max_context_len (slime)")
    eval_max_prompt_len: int | None = Field(None, ge=1, description="drop eval prompts longer than this many "
                                                                    "tokens (needs hf_checkpoint's tokenizer)")
    eval_min_new_tokens: int | None = Field(None, ge=0, description="eval responses are at least this long (SGLang "
                                                                    "min_new_tokens)")
    eval_num_engines: int = Field(1, ge=1, description="`slime evaluate`: inference engines started for the eval")
    eval_watch_run: str | None = Field(None, description="`slime evaluate`: evaluate the newest committed "
                                                         "checkpoint of this run (same store) instead of --load; "
                                                         "skip when it was evaluated with this config already")
    eval_watch_stages: list[str] = Field(["rl", "sft", "convert"], min_length=1,
                                         description="eval_watch_run: stages whose {run}/{stage}/checkpoint are "
                                                     "searched, first with a committed checkpoint wins")


class EngineConfig(_Section):
    """Which inference engine serves rollouts and where the router is."""

    engine: Literal["builtin", "sglang"] = Field("builtin", description="sglang: SGLang servers (CUDA); builtin: "
                                                 "the transformers engine speaking its HTTP protocol")
    rollout_external_engine_addrs: list[str] | None = Field(
        None, description="engines a user started (host:port or URL): registered with the router instead of "
                          "launched; stopping the run leaves them running (slime/engines/fleet.py)")
    http_proxy: str | None = Field(None, description="for plugins (args.http_proxy); engines and the router are "
                                                     "reached on 127.0.0.1 without it")
    sglang_router_ip: str = Field("127.0.0.1", description="address the router binds and is reached on")
    sglang_router_port: int | None = Field(None, ge=1, le=65535, description="None: pick a free port")
    engine_host: str = Field("127.0.0.1", description="address the engine servers bind; 0.0.0.0 (or the node's IP) "
                                                      "when the router is on another node: engines are then "
                                                      "registered by their node's IP (docs/ray.md)")
    use_fault_tolerance: bool = Field(False, description="`slime rl`: poll every engine's /health_generate; a dead "
                                                         "engine is restarted, re-synced and re-registered (docs/ray.md)")
    rollout_health_check_interval: float = Field(30.0, gt=0, description="fault tolerance: seconds between two "
                                                                         "health checks of the engines")
    rollout_health_check_timeout: float = Field(30.0, gt=0, description="fault tolerance: seconds a /health_generate "
                                                                        "may take before it counts as failed")
    rollout_health_check_first_wait: float = Field(0.0, ge=0, description="fault tolerance: seconds before the first "
                                                                          "check after start and after each onload")
    rollout_health_check_failures: int = Field(1, ge=1, description="fault tolerance: failed checks in a row after "
                                                                    "which an engine is restarted")
    rollout_max_engine_restarts: int = Field(3, ge=0, description="fault tolerance: restarts per engine in a run; "
                                                                  "past it the engine stays down, the others go on")


def check_over_sampling(config: ConfigTree, fail: Fail) -> None:
    """over_sampling_batch_size submits at least a rollout batch."""
    r = config.rollout
    if r.over_sampling_batch_size and r.rollout_batch_size and r.over_sampling_batch_size < r.rollout_batch_size:
        fail("rollout.over_sampling_batch_size",
             f"{r.over_sampling_batch_size} is smaller than rollout_batch_size {r.rollout_batch_size}",
             "rollout.rollout_batch_size")


def check_prompt_fits_context(config: ConfigTree, fail: Fail) -> None:
    """A prompt leaves room in rollout_max_context_len for one generated token."""
    context = config.rollout.rollout_max_context_len
    if context is not None and config.data.rollout_max_prompt_len > context - 1:
        fail("data.rollout_max_prompt_len", f"{config.data.rollout_max_prompt_len} must be at most "
             f"rollout_max_context_len - 1 = {context - 1}, so that a prompt leaves room for at least one generated "
             "token to compute the loss (slime)", "rollout.rollout_max_context_len")


def check_prompt_tokenizer(config: ConfigTree, fail: Fail, where: dict[str, str]) -> None:
    """Dropping long prompts needs hf_checkpoint's tokenizer (named by the field that was set)."""
    context = config.rollout.rollout_max_context_len
    if config.data.rollout_max_prompt_len and not config.checkpoint.hf_checkpoint:
        if "data.rollout_max_prompt_len" not in where and context is not None:
            fail("rollout.rollout_max_context_len", f"drops prompts longer than rollout_max_context_len - 1 = "
                 f"{context - 1} tokens (slime's default rollout_max_prompt_len), which needs "
                 "checkpoint.hf_checkpoint for its tokenizer")
        fail("data.rollout_max_prompt_len", "needs checkpoint.hf_checkpoint for its tokenizer")


def check_engine_dtype(config: ConfigTree, fail: Fail) -> None:
    """The built-in engine runs in one of its dtypes."""
    if config.engine.engine == "builtin" and (dtype := config.sglang_arg("dtype")) is not None \
            and str(dtype) not in DTYPES:
        fail("sglang.dtype", f"{dtype!r} is not a dtype the built-in engine runs in; one of {sorted(DTYPES)}")


def check_http_timeout(config: ConfigTree, fail: Fail) -> None:
    """rollout_http_timeout_s is not below the router's request timeout."""
    r = config.rollout
    if r.rollout_http_timeout_s is not None:
        try:
            router_s = request_timeout_s(config.router)
        except ConfigError as exc:
            fail("router.request_timeout_secs", str(exc))
        if r.rollout_http_timeout_s < router_s:
            fail("rollout.rollout_http_timeout_s", f"{r.rollout_http_timeout_s:g} s is below the router's request "
                 f"timeout, {router_s:g} s (--sglang-router-request-timeout-secs; sglang-router's default when not "
                 "given): generations the router allows would be cut here, unretried, while the engine goes on "
                 "generating. To bound generations lower the router's timeout; unset, this follows it",
                 "router.request_timeout_secs")


def check_external_engines(config: ConfigTree, fail: Fail) -> None:
    """External engine addresses parse, and fault tolerance cannot restart them."""
    if config.engine.rollout_external_engine_addrs:
        try:
            external_engine_urls(config.engine.rollout_external_engine_addrs)
        except ConfigError as exc:
            fail("engine.rollout_external_engine_addrs", str(exc))
        if config.engine.use_fault_tolerance:
            fail("engine.use_fault_tolerance", "restarts engines this run started: external engines "
                 "(rollout_external_engine_addrs) cannot be restarted here", "engine.rollout_external_engine_addrs")


def check_global_dataset(config: ConfigTree, fail: Fail) -> None:
    """Without the global dataset a custom rollout function makes the prompts."""
    if config.data.disable_rollout_global_dataset and \
            config.rollout.rollout_function_path == RolloutConfig.model_fields["rollout_function_path"].default:
        fail("data.disable_rollout_global_dataset", "the default rollout draws prompts from the global dataset (slime "
             "asserts it too): set rollout_function_path to a rollout function that makes its prompts")


def check_rollout_transport(config: ConfigTree, fail: Fail) -> None:
    """Rollout data reaches the trainer through the store."""
    if config.rollout.rollout_data_transport == "nixl":
        fail("rollout.rollout_data_transport", "NIXL is not built here: rollout data reaches the trainer as an "
             "Arrow shard set in the store (object-store)")
