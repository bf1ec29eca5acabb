"""Weight sync from a Megatron trainer into a built-in engine: seconds and GB/s per mode (slime.sync).

    python bench/sync.py --model tiny --device cpu --modes disk,tensor,distributed        # CPU, tiny kit
    python bench/sync.py --model 0.5b --device cuda --dtype bf16 --modes disk,tensor      # one GPU
    python bench/sync.py --model 0.5b --device cuda --dtype bf16 --modes distributed      # two GPUs (NCCL)
    python bench/sync.py --model tiny --device cpu --lora-rank 4 --modes disk,tensor,adapter   # LoRA: merged vs adapter

The trainer is this process: Megatron model chunks built through mbridge from an HF checkpoint (the
tiny kit's model, or a random-weight Qwen2.5 shape from slime.data.random_models), on cuda:0 or the
CPU. The engine is a real built-in engine server (slime.engines.builtin) with the same model and
dtype: for disk and tensor on the trainer's device (colocated), for distributed on cuda:1 (NCCL needs
one GPU per rank; on CPU both use gloo). Each mode runs `--warmup` untimed syncs (the distributed
group is formed there, as a long-lived syncer forms it once), then `--repeats` timed ones through one
`WeightSyncer` and one HTTP client, as the RL loop does; every sync is the whole bracket (pause, flush,
export, transfer, continue, version check). Reported per mode: the median total seconds and phases,
and GB/s = bytes / median total, where bytes are the parameter bytes sent in the synced dtype (each
tensor of the HF export once; the tied embedding once). Prints a table and one JSON line per mode.

With `--lora-rank R` the trainer's model carries LoRA adapters (rank R, alpha 2R, every linear layer; B drawn
small and non-zero, as after training): disk, tensor and distributed send the merged weights, `adapter`
(`sync.lora_sync: adapter`) writes only the adapters as a PEFT directory that the engine (started with
--enable-lora) loads; its bytes are the adapter tensors' (docs/lora.md).

Reference: slime reports ~7 s to sync a 30B model colocated (60 GB of bf16 weights: ~8.6 GB/s);
the table prints that figure next to the measured ones. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from slime.data.random_models import QWEN2_SHAPES, save_random_qwen2

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MODES = ("disk", "tensor", "distributed", "adapter")
SLIME_REFERENCE = {"model": "30B", "bytes": 60e9, "seconds": 7.0}  # slime, colocated, bf16


def model_dir(name: str, dtype: torch.dtype, scratch: Path) -> Path:
    """An HF checkpoint: the tiny kit's model (built in `scratch`), a random Qwen2.5 shape, or a directory."""
    if name == "tiny":
        from slime.data.tiny import make_tiny_kit

        return make_tiny_kit(scratch / "tiny-kit").model_dir
    if name in QWEN2_SHAPES:
        return save_random_qwen2(scratch / name, name, dtype)
    if not (Path(name) / "config.json").is_file():
        raise SystemExit(f"--model {name}: not tiny, {', '.join(QWEN2_SHAPES)} or an HF model directory")
    return Path(name)


def lora_spec(rank: int):
    """Adapters on every linear layer (alpha = 2 rank), None without LoRA."""
    from slime.backends.megatron import lora

    if not rank:
        return None
    return lora.LoraSpec(rank=rank, alpha=2.0 * rank, dropout=0.0,
                         targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))


def engine_device(mode: str, device: str) -> str | None:
    """Where the engine of `mode` runs; None when this machine cannot run the mode."""
    if device == "cpu":
        return "cpu"
    if mode != "distributed":  # adapter: the engine reads the PEFT directory, on the trainer's device
        return "cuda:0"
    return "cuda:1" if torch.cuda.device_count() >= 2 else None


async def timed_syncs(syncer, url: str, weights, mode: str, warmup: int, repeats: int) -> list:
    from slime.engines.client import EngineClient

    results = []
    async with EngineClient() as client:
        try:
            for i in range(warmup + repeats):
                result = await syncer.sync([url], weights, f"bench-{mode}-{i}", client=client)
                if i >= warmup:
                    results.append(result)
        finally:
            await syncer.close(client)
    return results


def summarise(mode: str, results: list, engine_at: str) -> dict:
    totals = [r.seconds["total"] for r in results]
    phases = sorted({p for r in results for p in r.seconds if p != "total"})
    seconds = statistics.median(totals)
    return {"mode": mode, "engine_device": engine_at, "bytes": results[0].bytes, "tensors": results[0].tensors,
            "buckets": results[0].buckets, "repeats": len(results), "seconds": round(seconds, 4),
            "min_seconds": round(min(totals), 4), "gb_per_s": round(results[0].bytes / 1e9 / seconds, 3),
            "phases": {p: round(statistics.median(r.seconds.get(p, 0.0) for r in results), 4) for p in phases}}


def print_table(rows: list[dict], model: str, device: str, dtype: str) -> None:
    ref = SLIME_REFERENCE
    print(f"\nweight sync, model {model}, trainer on {device}, {dtype}; median of the timed syncs")
    print(f"{'mode':<12} {'engine':<7} {'GB':>8} {'buckets':>7} {'seconds':>8} {'GB/s':>7}  phases (s)")
    for row in rows:
        phases = " ".join(f"{k}={v:.3f}" for k, v in row["phases"].items() if v >= 0.0005)
        print(f"{row['mode']:<12} {row['engine_device']:<7} {row['bytes'] / 1e9:>8.4f} {row['buckets']:>7} "
              f"{row['seconds']:>8.3f} {row['gb_per_s']:>7.3f}  {phases}")
    print(f"{'slime ref':<12} {'colo':<7} {ref['bytes'] / 1e9:>8.1f} {'':>7} {ref['seconds']:>8.1f} "
          f"{ref['bytes'] / 1e9 / ref['seconds']:>7.1f}  ({ref['model']} bf16, colocated, as slime reports it)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help=f"tiny, {', '.join(QWEN2_SHAPES)} or an HF model directory")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--modes", default="disk,tensor", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs per mode (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--buffer-mb", type=int, default=512, help="update_weight_buffer_size (tensor, distributed)")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on the trainer (mode "
                                                                 "adapter needs it)")
    args = parser.parse_args()
    dtype_name = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
    if "adapter" in modes and not args.lora_rank:
        raise SystemExit("--modes adapter: set --lora-rank (the adapters to sync)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")

    from slime.backends.megatron import lora
    from slime.backends.megatron.bridge import build_model, export_hf_weights, init_megatron, make_bridge
    from slime.backends.megatron.lora_export import peft_state_dict, write_peft_adapter
    from slime.config import SyncConfig
    from slime.engines.builtin.launcher import start_builtin_engine
    from slime.sync import WeightSyncer

    dtype = DTYPES[dtype_name]
    rows = []
    with tempfile.TemporaryDirectory(prefix="slime-bench-sync-") as tmp:
        scratch = Path(tmp)
        hf_dir = model_dir(args.model, dtype, scratch)
        if args.device == "cuda":
            torch.cuda.set_device(0)
        init_megatron(seed=0)
        bridge = make_bridge(str(hf_dir), dtype)
        spec = lora_spec(args.lora_rank)
        models = build_model(bridge, str(hf_dir), post_create=lora.lora_callback(spec))
        if spec is not None:
            with torch.no_grad():  # B off zero, as after training: merged weights differ from the base
                for name, param in lora.named_adapters(models):
                    if name.endswith("lora_b"):
                        param.normal_(0.0, 0.01)

        def weights():
            return export_hf_weights(bridge, models)

        def adapters():
            return iter(peft_state_dict(bridge, models).items())

        def write_adapter(state, out_dir):
            write_peft_adapter(state, spec, out_dir, base_model=str(hf_dir), hf_config=bridge.hf_config)

        for mode in modes:
            engine_at = engine_device(mode, args.device)
            if engine_at is None:
                print(f"{mode}: skipped (NCCL needs the engine on a second GPU; this machine has one)")
                continue
            adapter = mode == "adapter"
            flags = ["--enable-lora", "--max-lora-rank", str(args.lora_rank)] if adapter else []
            process, url = start_builtin_engine(str(hf_dir), log_path=scratch / f"engine-{mode}.log",
                                                device=engine_at, dtype=ENGINE_DTYPES[dtype_name], timeout_s=600,
                                                extra_args=flags)
            try:
                config = SyncConfig(weight_sync_mode="disk" if adapter else mode, lora_sync="adapter" if adapter
                                    else "merged", update_weight_buffer_size=args.buffer_mb << 20,
                                    update_weight_disk_dir=str(scratch / "weights"))
                syncer = WeightSyncer(config, hf_config=bridge.hf_config, backend="gloo" if args.device == "cpu" else "nccl",
                                      write_adapter=write_adapter if adapter else None)
                results = asyncio.run(timed_syncs(syncer, url, adapters if adapter else weights, mode, args.warmup,
                                                  args.repeats))
            finally:
                process.stop()
            rows.append(summarise(mode, results, engine_at))
    print_table(rows, f"{args.model}" + (f" + LoRA r{args.lora_rank}" if spec else ""), args.device, dtype_name)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {os.cpu_count()} cores"
    for row in rows:
        print(json.dumps({"bench": "sync", "model": args.model, "lora_rank": args.lora_rank, "device": args.device,
                          "machine": machine,
                          "dtype": dtype_name, "buffer_mb": args.buffer_mb, **row,
                          "slime_reference_gb_per_s": round(SLIME_REFERENCE["bytes"] / 1e9 / SLIME_REFERENCE["seconds"],
                                                            2)}), flush=True)


if __name__ == "__main__":
    main()
