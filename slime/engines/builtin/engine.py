"""The built-in engine: a `transformers` model behind the scheduler, answering in SGLang's shapes.

This module turns SGLang request bodies (`/generate`'s `GenerateReqInput` subset) into scheduler
requests and scheduler results into SGLang responses, and implements the control operations
(weight update from disk, memory release, cache flush). HTTP lives in `server.py`.

With `--tp-size N` this process is rank 0 of N (tp_group.py): it serves HTTP, schedules and samples, and its model
is its slice of the checkpoint (tp_shard.py); `start_tensor_parallel` starts the other ranks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import glob
import itertools
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from slime import __version__
from slime.config.layout import check_engine_tp
from slime.engines.builtin.batch import Request
from slime.engines.builtin.fusion import weight_slots
from slime.engines.builtin.lora import LoraAdapters
from slime.engines.builtin.memory import apply_memory_budget
from slime.engines.builtin.moe import check_moe_config, encode_routed_experts
from slime.engines.builtin.sampling import BadRequestError, SamplingParams
from slime.engines.builtin.scheduler import Scheduler
from slime.engines.builtin.slots import slot_support
from slime.engines.builtin.tp_group import TensorParallel, rank_device
from slime.engines.builtin.tp_shard import install_all_reduce, shard_parameters
from slime.engines.builtin.weights import WeightChecker, WeightUpdater, mtp_layers, mtp_tensor_names
from slime.errors import ConfigError, EngineStartError
from slime.offload import HostParking

logger = logging.getLogger(__name__)

# /generate fields (SGLang's GenerateReqInput) this engine implements.
# return_routed_experts (MoE models only; a dense model answers 400): meta_info["routed_experts"] as SGLang gives it
# (moe.encode_routed_experts), from routed_experts_start_len on.
_SUPPORTED_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                     "lora_path", "return_routed_experts", "routed_experts_start_len"}
# Fields that carry routing or bookkeeping information only; sglang-router adds some of them (`model`)
# to every body it forwards. Ignored whatever their value.
_INFORMATIONAL_FIELDS = {"model", "routing_key", "priority", "log_metrics", "no_logs", "extra_key", "custom_labels",
                         "conversation_id", "external_trace_header", "received_time", "data_parallel_rank",
                         "return_text_in_logprobs", "session_id", "http_worker_ipc"}
# Any other field (stream, image_data, top_logprobs_num, return_hidden_states, lora_id, ...) asks for a
# feature this engine lacks: accepted only when unset, refused otherwise rather than silently ignored.


@dataclass
class EngineArgs:
    """How the engine starts (mirrors the SGLang flags of the same name)."""

    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"
    dtype: str = "auto"
    random_seed: int = 0
    max_running_requests: int = 256
    context_length: int | None = None
    served_model_name: str | None = None
    weight_version: str = "default"
    kv_cache: str = "auto"  # auto (slots on CUDA for Qwen2/Qwen3/Qwen3-MoE/GLM-4.5/Llama), slots, dynamic
    disable_cuda_graph: bool = False
    max_slot_tokens: int = 4096  # slot mode: prompt + new tokens of one request (KV memory per slot)
    disable_overlap_schedule: bool = False  # slot mode: wait for each step's tokens before the next decode
    disable_fused_projections: bool = False  # slot mode: q/k/v and gate/up as the modules' own GEMMs (fusion.py)
    disable_sampler_compile: bool = False  # CUDA: the sampler's common path eager (sampling.compiled_draw)
    disable_slot_prefill: bool = False  # slot mode: prefill by the transformers forward + a copy into the slots
    disable_fused_kv_write: bool = False  # CUDA slot decode: rotary and the two K/V cache writes as separate kernels
    chunked_prefill_size: int = 32768  # slot prefill: padded prompt tokens per forward pass (-1: one pass a group)
    mem_fraction_static: float | None = None  # a GPU shared with a train rank: this engine's part (memory.py)
    enable_lora: bool = False  # SGLang's LoRA flags: /load_lora_adapter merges one adapter (lora.py)
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    admission_window_ms: float = 10.0  # arrivals quiet this long: the waiting group is admitted (scheduler.py)
    gc_freeze: bool = False  # the server process sets it (--disable-gc-freeze clears it): see Scheduler
    tp_size: int = 1  # SGLang's flag: the model split over this many devices, one process each (tp_group.py)


def resolve_device(name: str) -> torch.device:
    """The engine's device, with an explicit index on CUDA (`cuda` -> `cuda:N`, the current device):
    NCCL groups and `torch.cuda.set_device` need one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "half": torch.float16}[name]


def load_model(model_path: str, device: torch.device, dtype: torch.dtype) -> Any:
    """The HF checkpoint at `model_path` as a `transformers` causal LM on `device`, in inference mode (every rank of
    a tensor-parallel engine loads it so, then keeps its slice: tp_shard.py).

    A GLM-4.5 checkpoint ships its multi-token-prediction layer(s) as `model.layers.{num_hidden_layers + i}.*`
    (`num_nextn_predict_layers`): SGLang uses them only for speculative decoding, which this engine does not do, so
    they are left unread with one log line (`transformers` ignores them silently only for the layer counts of the
    released GLM-4.5 and GLM-4.5-Air, and lists them as unexpected otherwise)."""
    config = AutoConfig.from_pretrained(model_path)
    mtp = mtp_tensor_names(checkpoint_names(model_path), config)
    if not mtp:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    logger.info("ignoring the checkpoint's %d multi-token-prediction tensors (model.layers.%s.*, "
                "num_nextn_predict_layers=%s): the built-in engine does no speculative decoding", len(mtp),
                "|".join(str(i) for i in mtp_layers(config)), getattr(config, "num_nextn_predict_layers", None))
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    patterns = [*(model_class._keys_to_ignore_on_load_unexpected or []),
                *(rf"model\.layers\.{i}\." for i in mtp_layers(config))]
    # a subclass that also ignores them (the class attribute of `transformers`' own class is left as it is)
    quiet = type(model_class.__name__, (model_class,), {"_keys_to_ignore_on_load_unexpected": patterns,
                                                       "__module__": model_class.__module__})
    return quiet.from_pretrained(model_path, config=config, dtype=dtype).to(device).eval()


def checkpoint_names(model_path: str) -> list[str]:
    """The tensor names of the safetensors checkpoint at `model_path` (its index, else every file's header); empty
    where there is none (another format: `transformers` reads it)."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return list(json.load(f).get("weight_map", {}))
    names: list[str] = []
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def start_tensor_parallel(args: EngineArgs, model: Any, device: torch.device) -> TensorParallel:
    """Split `model` (rank 0's, loaded) for `args.tp_size` ranks and start the other ranks (tp_group.py). Whatever
    the engine cannot split or mirror is refused first with a ConfigError, before any other process starts."""
    world = args.tp_size
    if args.enable_lora:
        raise ConfigError(f"--tp-size {world}: --enable-lora is not supported with tensor parallelism (the merged "
                          "adapter's deltas are not split over the ranks)")
    reason = slot_support(model)
    if args.kv_cache == "dynamic" or reason is not None:
        why = "--kv-cache dynamic turns it off" if reason is None else f"it does not support {reason}"
        raise ConfigError(f"--tp-size {world} needs the slot KV cache (--kv-cache auto or slots): {why}")
    devices = [str(rank_device(device, rank, world)) for rank in range(world)]
    shard_parameters(model, 0, world)
    tp = TensorParallel.lead(world, device, lambda rank: {**dataclasses.asdict(args), "device": devices[rank]})
    try:
        install_all_reduce(model, tp.all_reduce)
        tp.call("ready")  # every rank loaded and split its model
    except Exception as exc:
        tp.stop()
        raise EngineStartError(f"tensor-parallel engine did not start: {type(exc).__name__}: {exc}") from exc
    tp.watch()
    return tp


class BuiltinEngine:
    """Model + tokenizer + scheduler, with SGLang's request and response formats."""

    def __init__(self, args: EngineArgs) -> None:
        if not args.admission_window_ms >= 0:
            raise ConfigError(f"--admission-window-ms must be >= 0, got {args.admission_window_ms}")
        if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
            raise ConfigError(f"--chunked-prefill-size must be a positive number of tokens or -1 (no limit), "
                              f"got {args.chunked_prefill_size}")
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        config = AutoConfig.from_pretrained(args.model_path)
        check_moe_config(config)  # a router the engine cannot run is refused before any weight is read
        if args.tp_size != 1:  # so is a bad split
            check_engine_tp(config, args.tp_size)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.model = load_model(args.model_path, self.device, self.dtype)
        self.model_path = args.model_path
        self.tp = start_tensor_parallel(args, self.model, self.device) if args.tp_size > 1 else None
        try:
            self._start(args)
        except BaseException:
            if self.tp is not None:
                self.tp.stop()
            raise

    def _start(self, args: EngineArgs) -> None:
        self.scheduler = Scheduler(
            self.model, self.tokenizer, device=self.device, seed=args.random_seed,
            max_running_requests=args.max_running_requests, context_length=args.context_length,
            kv_cache=args.kv_cache, cuda_graphs=not args.disable_cuda_graph, max_slot_len=args.max_slot_tokens,
            overlap=not args.disable_overlap_schedule, fuse_projections=not args.disable_fused_projections,
            admission_window_s=args.admission_window_ms / 1000, gc_freeze=args.gc_freeze,
            compile_sampler=not args.disable_sampler_compile, slot_prefill=not args.disable_slot_prefill,
            fuse_kv_write=not args.disable_fused_kv_write, chunked_prefill_size=args.chunked_prefill_size,
            tp=self.tp,
        )
        self.scheduler.weight_version = args.weight_version
        self.memory_budget: dict[str, Any] | None = None  # --mem-fraction-static: what it decided
        if args.mem_fraction_static is not None:  # before the first request allocates the slot cache
            self.memory_budget = apply_memory_budget(self.scheduler, self.model, self.device,
                                                     args.mem_fraction_static)
        self.weights = WeightUpdater(self.model, self.device, lambda fn: self.scheduler.run_command(fn).result(),
                                     tp=self.tp)
        self.checker = WeightChecker(self.model, self.tp)  # /weights_checker
        self.lora = LoraAdapters(self.model, lambda fn: self.scheduler.run_command(fn).result(),
                                 enabled=args.enable_lora, max_rank=args.max_lora_rank,
                                 target_modules=args.lora_target_modules, model_path=args.model_path)
        self.weights.guard = self.lora.check_full_update  # a merged adapter's base would go stale
        self.parking = HostParking()  # the weights' pinned host twins while the memory is released
        self.last_weight_update: dict[str, Any] | None = None  # what /server_info reports about it
        self._rid_prefix, self._rid_counter = uuid.uuid4().hex[:16], itertools.count()
        self.scheduler.start()
        logger.info("built-in engine: %s on %s (%s)%s", args.model_path, self.device, self.dtype,
                    f", tensor parallel over {args.tp_size} ranks" if self.tp is not None else "")

    def shutdown(self) -> None:
        """Stop the model thread, then the other tensor-parallel ranks (which exit once told)."""
        self.scheduler.stop()
        if self.tp is not None:
            self.tp.stop()

    # ------------------------------------------------------------------ /generate

    async def generate(self, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """Handle one `/generate` body: a single request, or a batch when the inputs are lists."""
        for name in sorted(set(body) - _SUPPORTED_FIELDS - _INFORMATIONAL_FIELDS):
            if body[name] not in (None, False, 0, "", [], {}):
                raise BadRequestError(f"/generate field {name!r}={body[name]!r:.60} is not supported by the "
                                      "built-in engine (use engine: sglang)")
        if ("text" in body) == ("input_ids" in body):
            raise BadRequestError("give exactly one of 'text' or 'input_ids'")
        inputs = body.get("input_ids", body.get("text"))
        batched = isinstance(inputs, list) and bool(inputs) and isinstance(inputs[0], list | str)
        items = inputs if batched else [inputs]
        kind = str if "text" in body else list
        if not all(isinstance(item, kind) for item in items):
            raise BadRequestError("input_ids must be a list of integers (or a list of such lists); "
                                  "text a string (or a list of strings)")
        n = len(items)

        def per_item(name: str, default: Any) -> list[Any]:
            """A field given once for all inputs, or (batched) as one entry per input."""
            value = body.get(name, default)
            if not isinstance(value, list):
                return [value] * n
            if not batched or len(value) != n:
                raise BadRequestError(f"{name} is a list of {len(value)} but there are {n} inputs")
            return value

        sampling = per_item("sampling_params", {})
        rids = per_item("rid", None)
        return_logprob = per_item("return_logprob", False)
        start_len = per_item("logprob_start_len", -1)
        routed = per_item("return_routed_experts", False)
        routed_start = per_item("routed_experts_start_len", 0)
        if any(routed) and not self.scheduler.moe_top_k:
            raise BadRequestError(f"return_routed_experts: {self.model.config.model_type} model "
                                  f"{self.model_path} has no MoE layers, so no routed experts to return")
        for lora_path in per_item("lora_path", None):  # merged into the weights: only the loaded one (lora.py)
            self.lora.check_request(lora_path)
        # validate every item before submitting any, so a bad item leaves no orphaned work behind
        parsed = []
        for i, item in enumerate(items):
            params = SamplingParams.from_request(sampling[i])
            ids = self._tokens(item)
            self.scheduler.check_input(ids, params.max_new_tokens)
            start_routed = routed_start[i] if routed_start[i] is not None else 0
            if routed[i] and not (isinstance(start_routed, int) and 0 <= start_routed <= len(ids)):
                raise BadRequestError(f"routed_experts_start_len={start_routed!r} must be an integer in "
                                      f"[0, {len(ids)}] (the prompt's tokens)")
            parsed.append((ids, params, rids[i] or self._new_rid(),
                           start_len[i] if return_logprob[i] and start_len[i] is not None else -1,
                           bool(routed[i]), start_routed))
        futures = [self.scheduler.submit(ids, params, rid, logprob_start_len=start, return_routed_experts=routed_i,
                                         routed_experts_start_len=routed_from)
                   for ids, params, rid, start, routed_i, routed_from in parsed]
        started = time.perf_counter()
        results = await asyncio.gather(*futures)
        finished = time.perf_counter()
        outputs = [self._response(r, bool(return_logprob[i]), finished - started) for i, r in enumerate(results)]
        self.scheduler.stats.built(time.perf_counter() - finished)
        return outputs if batched else outputs[0]

    def _new_rid(self) -> str:
        """A unique 32-hex-digit id like SGLang's uuid4().hex, without a `getrandom` call per request:
        that call releases the GIL, and taking it back from a busy model thread costs up to the
        interpreter's switch interval (seen as most of the HTTP thread's time under py-spy)."""
        return f"{self._rid_prefix}{next(self._rid_counter):016x}"

    def _tokens(self, item: Any) -> list[int]:
        if isinstance(item, str):
            return self.tokenizer.encode(item, add_special_tokens=False)
        if isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            return item
        raise BadRequestError("input_ids must be a list of integers (or a list of such lists); text a string")

    def _response(self, request: Request, return_logprob: bool, latency: float) -> dict[str, Any]:
        params = request.params
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=params.skip_special_tokens)
        if request.matched_stop and not params.no_stop_trim:
            text = text[: text.find(request.matched_stop)] if request.matched_stop in text else text
        meta: dict[str, Any] = {
            "id": request.rid,
            "finish_reason": request.finish_reason,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(request.output_ids),
            "cached_tokens": 0,
            "weight_version": self.scheduler.weight_version,
            "e2e_latency": latency,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                             zip(request.output_logprobs, request.output_ids, strict=True)]
            start = max(request.logprob_start_len, 0)
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in
                                            zip(request.input_logprobs, request.input_ids[start:], strict=False)]
        if request.return_routed_experts:  # every fed token: prompt + output less the last (never fed)
            end = len(request.input_ids) + len(request.output_ids) - 1
            if (request.finish_reason or {}).get("type") == "abort":  # aborted while waiting: never prefilled
                end = min(end, sum(len(chunk) for chunk in request.routed_experts))
            start = min(request.routed_experts_start_len, end)
            meta["routed_experts"] = encode_routed_experts(request.routed_experts, start, end)
            meta["routed_experts_start_len"] = start
        return {"text": text, "output_ids": list(request.output_ids), "meta_info": meta}

    # ------------------------------------------------------------------ control

    def update_weights_from_disk(self, model_path: str, weight_version: str | None) -> dict[str, Any]:
        """Load HF safetensors from `model_path` into the live model, in place, between two steps."""
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            return {"success": False, "message": f"no *.safetensors files in {model_path}", "num_paused_requests": 0}

        def load() -> str:
            self.lora.check_full_update()
            state: dict[str, torch.Tensor] = {}
            for path in files:
                state.update(load_file(path))
            state = dict(self.weights.targets.without_mtp(list(state.items())))  # GLM-4.5's MTP layer: not served
            tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            missing = [name for name in self.weights.targets.missing(set(state)) if name not in tied]
            unexpected = sorted(name for name in state if self.weights.targets.target(name) is None)
            if missing or unexpected:  # checked before anything is copied: a refused update changes nothing
                raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}")
            for name, tensor in state.items():
                self.weights.targets.check(name, tensor.shape, tensor.dtype)
            self.weights.targets.copy_in(list(state.items()))
            return f"loaded {len(state)} tensors from {model_path}"

        result = self._weight_update("disk", lambda: self.scheduler.run_command(load).result(), weight_version)
        if result["success"]:
            self.model_path = model_path
        return {**result, "num_paused_requests": 0}

    def load_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's /load_lora_adapter: merge the PEFT adapter at `lora_path` (lora.py), replacing the one held."""
        result = self.lora.load(body.get("lora_name"), body.get("lora_path"), bool(body.get("pinned")))
        log = logger.info if result["success"] else logger.warning
        log("load_lora_adapter %s (%s): %s", body.get("lora_name"), body.get("lora_path"),
            result["error_message"] or "loaded")
        return result

    def unload_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's /unload_lora_adapter: the base weights back, bit-exact."""
        return self.lora.unload(body.get("lora_name"))

    def check_weights(self, action: Any) -> dict[str, Any]:
        """SGLang's /weights_checker (`weights.WeightChecker`), run between two scheduler steps."""
        message = self.scheduler.run_command(lambda: self.checker.run(action)).result()
        return {"success": True, "message": message}

    def update_weights_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's /update_weights_from_tensor (see weights.py for the transport)."""
        return self._weight_update(
            "tensor", lambda: self.weights.from_tensor(body.get("serialized_named_tensors"), body.get("load_format")),
            body.get("weight_version"), body.get("abort_all_requests"))

    def update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's /update_weights_from_distributed: receive the announced tensors from the group."""
        result = self._weight_update("distributed", lambda: self.weights.from_distributed(body),
                                     body.get("weight_version"), body.get("abort_all_requests"))
        if result["success"] and body.get("checksums") is not None:  # every tensor was checked (slime's delta)
            result["checksums_verified"] = len(body["checksums"])
        return result

    def init_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._control(lambda: self.weights.init_group(body))

    def destroy_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._control(lambda: self.weights.destroy_group(body.get("group_name")))

    @staticmethod
    def _control(fn: Any) -> dict[str, Any]:
        try:
            return {"success": True, "message": fn()}
        except (BadRequestError, ValueError) as exc:  # the update itself is wrong
            return {"success": False, "message": str(exc)}
        except Exception as exc:  # a store or group that cannot be reached: reported, the engine keeps serving
            logger.exception("weight update group operation failed")
            return {"success": False, "message": f"{type(exc).__name__}: {exc}"}

    def _weight_update(self, source: str, apply: Any, weight_version: Any, abort_all: Any = False) -> dict[str, Any]:
        """Run one in-place update; {"success", "message"} as SGLang answers, the version set on success."""
        if weight_version is not None and not isinstance(weight_version, str):
            return {"success": False, "message": f"weight_version must be a string, got {weight_version!r}"}
        if abort_all:
            self.scheduler.abort(abort_all=True)
        paused = self.scheduler.paused
        result = self._control(apply)
        if result["success"] and weight_version is not None:
            self.scheduler.weight_version = weight_version
            result["message"] += f" Weight version updated to {weight_version}."
        self.last_weight_update = {"source": source, "success": result["success"], "paused": paused,
                                   "weight_version": self.scheduler.weight_version, "time": time.time()}
        if not result["success"]:
            logger.warning("weight update from %s refused: %s", source, result["message"])
        return result

    def release_memory(self) -> None:
        """Give back accelerator memory (weights to pinned host twins kept between releases, `slime.offload`);
        refused while requests are in flight."""
        if self.scheduler.busy:
            raise BadRequestError("cannot release memory while requests are running; pause and abort first")
        self.scheduler.set_released(True)
        if self.device.type == "cuda":  # the slot cache and its graphs point at the old weights: rebuilt later
            self.scheduler.run_command(lambda: (self.scheduler.drop_kv_cache(),
                                                self.parking.park(weight_slots(self.model,
                                                                               self.scheduler.projections)),
                                                self.tp is not None and self.tp.call("park"))).result()
            with torch.cuda.device(self.device):  # this HTTP worker thread's current device may be another
                torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if self.device.type == "cuda":
            self.scheduler.run_command(lambda: (self.parking.unpark(),
                                                self.tp is not None and self.tp.call("unpark"))).result()
        self.scheduler.set_released(False)

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
        }

    def server_info(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in vars(self.args).items()},
            "weight_version": self.scheduler.weight_version,
            "engine": "slime-builtin",
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "internal_states": [{**self.scheduler.load(), "steps": self.scheduler.steps,
                                 "prefills": self.scheduler.prefills,
                                 "decodes_ahead": self.scheduler.decodes_ahead,
                                 "sampler_compiled": self.scheduler.compile_sampler,
                                 "slot_prefill": self.scheduler.slot_prefill,
                                 "fused_kv_write": self.scheduler.fuse_kv_write,
                                 "generated_tokens": self.scheduler.generated_tokens,
                                 "paused": self.scheduler.paused,
                                 "last_weight_update": self.last_weight_update,
                                 "weight_update_groups": sorted(self.weights.groups),
                                 "lora_adapters": self.lora.names(),
                                 "busy_period": self.scheduler.stats.snapshot(),
                                 "gc_frozen_objects": gc.get_freeze_count(),
                                 "tensor_parallel": self._tp_info()}],
            "version": __version__,
        }

    def _tp_info(self) -> dict[str, Any] | None:
        """/server_info's view of the ranks: what a caller needs to see them all stop (pids, the store's port)."""
        if self.tp is None:
            return None
        return {"size": self.tp.world, "worker_pids": [w.pid for w in self.tp.workers],
                "master_port": self.tp.master_port, "backend": "nccl" if self.device.type == "cuda" else "gloo"}
