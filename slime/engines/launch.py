"""Start one engine of a fleet in this process: built-in or SGLang, bound to `engine.engine_host`, on the GPUs it
is given (`CUDA_VISIBLE_DEVICES`; a built-in engine given several runs tensor parallel over them, `--tp-size`), with
the memory share and LoRA flags the config asks for. Used by the fleet for its local engines and by `EngineHost`
(a Ray actor) for the engines it runs on other nodes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slime.config import LORA_HF_TO_MEGATRON, Config
from slime.config.engine_flags import flags_to_argv
from slime.engines.builtin.launcher import start_builtin_engine
from slime.engines.sglang_server import SGLangEngine

_launch_lock = threading.Lock()  # CUDA_VISIBLE_DEVICES is process-wide: one launch at a time


@contextlib.contextmanager
def _visible_devices(devices: list[int]) -> Iterator[None]:
    """`CUDA_VISIBLE_DEVICES` for a child started inside the block (hold `_launch_lock`)."""
    if not devices:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


SGLANG_STATIC_OF_SHARE = 0.8  # share_gpu: SGLang's static memory (weights + KV) within the engine's part


def engine_memory_limit(config: Config) -> float | None:
    """The `--mem-fraction-static` an engine gets when it shares its GPU with a train rank (`cluster.share_gpu`):
    the built-in engine's whole memory cap (its slot KV cache is sized to fit), or for SGLang, whose flag
    counts weights and KV cache only (CUDA graphs and activations come on top), 0.8 of the engine's part
    unless `--sglang-mem-fraction-static` sets it. None when not sharing."""
    if not config.cluster.share_gpu:
        return None
    rollout = config.cluster.gpu_fractions()[1]
    if config.engine.engine == "sglang":
        given = config.sglang_arg("mem_fraction_static")
        return float(given) if given is not None else round(rollout * SGLANG_STATIC_OF_SHARE, 4)
    return rollout


def lora_engine_args(config: Config) -> dict[str, Any]:
    """SGLang's LoRA launch flags under adapter sync (`sync.lora_sync: adapter`): `--enable-lora`, the adapter's
    rank as `--max-lora-rank` and its HF module names as `--lora-target-modules` (what the PEFT directory the
    trainer writes targets); the built-in engine takes the same flags. Empty otherwise."""
    if config.sync.lora_sync != "adapter":
        return {}
    megatron = set(config.lora.megatron_targets())
    modules = [hf for hf, linear in LORA_HF_TO_MEGATRON.items() if linear in megatron]
    return {"enable_lora": True, "max_lora_rank": config.lora.lora_rank, "lora_target_modules": modules}


# SGLang flags the built-in engine takes too, with the same meaning: a `sglang:` value of one reaches it
BUILTIN_SGLANG_ARGS = ("max_running_requests", "context_length")


def builtin_engine_args(config: Config, memory_limit: float | None, num_devices: int) -> list[str]:
    """The built-in engine's command-line flags from the config: its memory share (`engine_memory_limit`), the LoRA
    flags of adapter sync, the `sglang:` flags it shares with SGLang (`BUILTIN_SGLANG_ARGS`: how many requests run
    at once and their context, which size its slot KV cache) and, on several GPUs, `--tp-size`."""
    extra = ["--mem-fraction-static", str(memory_limit)] if memory_limit is not None else []
    extra += flags_to_argv(lora_engine_args(config))
    extra += flags_to_argv({key: config.sglang[key] for key in BUILTIN_SGLANG_ARGS if key in config.sglang})
    if num_devices > 1:  # cluster.rollout_num_gpus_per_engine: the model split over them (tp_group.py)
        extra += ["--tp-size", str(num_devices)]
    return extra


def launch_engine(config: Config, model_dir: str, log_path: Path, index: int, devices: list[int],
                  keep: Any = None) -> str:
    """Start engine `index` of a fleet in this process (built-in or SGLang, bound to `engine.engine_host`,
    `CUDA_VISIBLE_DEVICES` = `devices`) and wait until it can generate; `keep(server)` receives the
    server as soon as it exists (to stop it, also after a failed start). Returns the URL other nodes
    reach it at: by this node's IP when it binds a wildcard address (the router may be on another node)."""
    c, host = config, config.engine.engine_host
    keep = keep or (lambda server: None)
    limit = engine_memory_limit(c) if devices else None  # on the CPU there is no GPU to share
    if c.engine.engine == "sglang":
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))} if devices else {}
        # R3: SGLang returns the routed experts only when launched with it (slime sets it likewise)
        routing = {"enable_return_routed_experts": True} if c.algorithm.use_rollout_routing_replay else {}
        sglang_args = {**lora_engine_args(c), **routing, **c.sglang}  # flags the user gives win
        sglang_args = sglang_args if limit is None else {**sglang_args, "mem_fraction_static": limit}
        engine = SGLangEngine(model_dir, sglang_args=sglang_args, log_path=log_path, env=env, host=host)
        keep(engine)
        return reachable_url(engine.start().url, host)
    extra = builtin_engine_args(c, limit, len(devices))
    dtype = str(c.sglang_arg("dtype") or "auto")  # --sglang-dtype, checked when the config loads
    with _launch_lock, _visible_devices(devices):
        server, url = start_builtin_engine(model_dir, log_path=log_path, host=host, random_seed=c.run.seed + index,
                                           dtype=dtype, extra_args=extra)
    keep(server)
    return reachable_url(url, host)


def reachable_url(url: str, bind_host: str) -> str:
    """`url` of a server bound to `bind_host`, as another node reaches it: a wildcard bind (0.0.0.0)
    is advertised by this node's IP when this process runs under Ray (by 127.0.0.1 otherwise)."""
    if bind_host not in ("0.0.0.0", "", "::"):
        return url
    import ray

    if not ray.is_initialized():
        return url
    ip = ray.util.get_node_ip_address()
    return url.replace("://127.0.0.1:", f"://[{ip}]:" if ":" in ip else f"://{ip}:", 1)
