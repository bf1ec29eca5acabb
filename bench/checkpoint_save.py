"""Checkpoint save throughput and the train step's stall: synchronous against --async-save, on random Qwen2 models.

    python bench/checkpoint_save.py --model 136m --dir /tmp/ckpt-bench
    python bench/checkpoint_save.py --model 1.5b --dir /tmp/ckpt-bench --repeats 3
    python bench/checkpoint_save.py --model runs/tiny-kit/model --dir /tmp/ckpt-bench   # the CPU kit's model, on CPU

Builds the model through mbridge (bf16 params, fp32 master weights, Adam: 16 bytes a parameter, plus the
optimizer's step counters), takes two train steps so the optimizer state exists, then saves the full training
state `--repeats` times each way with `slime.backends.megatron.checkpoint.save_checkpoint`:

* sync: the call's whole time is the stall (planning, device-to-host copy, the write with fsync, the
  manifest's sha256/crc32 of every file). `write_gbps` = checkpoint bytes / that time;
* async (`saver=AsyncSaver()`): `stall_s` is the time until the call returns and training can go on; then
  train steps run (polling the saver after each, as the train actor does) until the checkpoint is committed:
  `commit_s` (save start to manifest), `background_gbps` = bytes / commit_s, and the step time while the
  writers run against the step time without (`step_s_while_writing`, `step_s`).

For scale, `host_copy_s`: one copy of every parameter and optimizer tensor of the rank to host memory (what
an async save must at least do before training can go on), and `dd_gbps`: this disk's sequential write rate
(dd, 2 GiB, fsync) in the same directory. Each figure is the median of the repeats; one JSON line per mode.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import time
from typing import Any

import torch

# the GPU kit's model (datasets/gpu-small/recipe.yaml: 136M parameters with its small tokenizer's vocabulary);
# the others are slime.data.random_models' Qwen2.5 shapes, or a model directory's config.json (a kit's model)
EXTRA_SHAPES = {
    "136m": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=2816, vocab_size=1024, tie_word_embeddings=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="136m", help="136m, a Qwen2.5 size of slime.data.random_models, or an HF "
                                                         "model directory (its config.json's shape, random weights)")
    parser.add_argument("--dir", required=True, help="where to write (removed and re-created)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--seq", type=int, default=256, help="train step sequence length (the steps around saves)")
    parser.add_argument("--threads", type=int, default=None,
                        help="writer processes per rank and directory (default: dist_checkpoint.save_threads())")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="run each mode's first save under cProfile: print its ROWS costliest functions")
    args = parser.parse_args()

    from transformers import AutoConfig, Qwen2Config

    from slime.backends.megatron import dist_checkpoint
    from slime.backends.megatron.async_save import AsyncSaver
    from slime.backends.megatron.checkpoint import iteration_dir, save_checkpoint
    from slime.data.random_models import QWEN2_SHAPES
    from slime.storage.manifest import is_committed, read_manifest

    if args.threads:
        dist_checkpoint.save_threads = lambda: args.threads
    if not torch.cuda.is_available():
        from slime.backends.megatron import cpu_compat

        cpu_compat.activate()
    if os.path.isdir(args.model):
        config = AutoConfig.from_pretrained(args.model)
    else:
        config = Qwen2Config(max_position_embeddings=4096, **(EXTRA_SHAPES.get(args.model) or QWEN2_SHAPES[args.model]))
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    models, optimizer, step = build(config, dtype, args.seq)
    for _ in range(2):
        step()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    params = sum(p.numel() for p in models[0].parameters())
    common = {"model": args.model, "params": params, "device": _device(), "save_threads": dist_checkpoint.save_threads(),
              "host_copy_s": _median(lambda: host_copy(models, optimizer), 3),
              "pinned_copy_s": pinned_copy(models, optimizer), "dd_gbps": dd_gbps(args.dir)}
    step_s = _median(step, 3)
    iteration = 0
    for mode in args.modes.split(","):
        rows = []
        for _ in range(args.repeats):
            iteration += 1
            saver = AsyncSaver() if mode == "async" else None
            profiler = cProfile.Profile() if args.profile and not rows else None
            t0 = time.monotonic()
            if profiler is not None:
                profiler.enable()
            save_checkpoint(models, os.path.join(args.dir, mode), iteration, optimizer=optimizer, saver=saver)
            stall = time.monotonic() - t0
            if profiler is not None:
                profiler.disable()
                print(f"--- {mode} save: the call's costliest functions (cumulative)", flush=True)
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
            path = iteration_dir(os.path.join(args.dir, mode), iteration)
            row: dict[str, Any] = {"stall_s": stall}
            if saver is not None:
                during = []
                while not saver.committed:
                    s0 = time.monotonic()
                    step()
                    during.append(time.monotonic() - s0)
                    saver.poll()
                row["commit_s"] = time.monotonic() - t0
                row["step_s_while_writing"] = statistics.median(during)
                row["steps_while_writing"] = len(during)
                saver.close()
            assert is_committed(path)
            row["bytes"] = sum(entry.bytes for entry in read_manifest(path).files)
            row["files"] = len(read_manifest(path).files)
            rows.append(row)
            shutil.rmtree(path)
            step()
        out = {"mode": mode, **common, "step_s": step_s, "bytes": rows[0]["bytes"], "files": rows[0]["files"],
               "repeats": args.repeats}
        for key in rows[0]:
            if key not in ("bytes", "files"):
                out[key] = statistics.median(row[key] for row in rows)
        seconds = out["commit_s"] if mode == "async" else out["stall_s"]
        out["background_gbps" if mode == "async" else "write_gbps"] = out["bytes"] / seconds / 1e9
        out["first_stall_s"] = rows[0]["stall_s"]  # pays the pinned host buffers' allocation
        out["stall_over_host_copy"] = out["stall_s"] / common["host_copy_s"]
        if common["pinned_copy_s"]:
            out["stall_over_pinned_copy"] = out["stall_s"] / common["pinned_copy_s"]
        print(json.dumps(out), flush=True)


def build(config: Any, dtype: torch.dtype, seq: int) -> tuple[list[torch.nn.Module], Any, Any]:
    """(models, optimizer, one train step) of a random-weight model of `config` on this machine's device."""
    import tempfile

    from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
    from slime.backends.megatron.optimizer import build_optimizer
    from slime.backends.megatron.train import StepSettings, train_step
    from slime.types import Sample

    init_megatron(seed=0)
    with tempfile.TemporaryDirectory() as hf_dir:
        config.save_pretrained(hf_dir)
        bridge = make_bridge(hf_dir, dtype)
        models = build_model(bridge, wrap_with_ddp=True)
    optimizer = build_optimizer(models, lr=1e-5, clip_grad=1.0, bf16=dtype is torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, config.vocab_size, (seq,), generator=generator).tolist(),
                      response_length=seq - 1) for i in range(4)]
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=2)

    def step() -> None:
        train_step(models, optimizer, samples, settings, vocab_size=config.vocab_size)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return models, optimizer, step


def host_copy(models: list[torch.nn.Module], optimizer: Any) -> None:
    """Every parameter and optimizer-state tensor of this rank copied to (pageable) host memory once."""
    copies = [t.to("cpu") for t in _state_tensors(models, optimizer)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    del copies


def pinned_copy(models: list[torch.nn.Module], optimizer: Any) -> float | None:
    """Median time of copying the same tensors into pinned host buffers allocated beforehand (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    tensors = _state_tensors(models, optimizer)
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def copy() -> None:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()

    return _median(copy, 3)


def dd_gbps(directory: str, gib: int = 2) -> float:
    """This disk's sequential write rate with dd (fsync at the end), in GB/s."""
    target = os.path.join(directory, "dd.bin")
    t0 = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={gib * 64}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.monotonic() - t0
    os.remove(target)
    return gib * 2**30 / seconds / 1e9


def _state_tensors(models: list[torch.nn.Module], optimizer: Any) -> list[torch.Tensor]:
    """The model's parameters, the optimizer's fp32 main weights and its moments."""
    from slime.backends.megatron.optimizer import torch_optimizers

    tensors = [p.detach() for model in models for p in model.parameters()]
    for inner in torch_optimizers(optimizer):
        tensors += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()]
        tensors += [p.detach() for group in inner.param_groups for p in group["params"]]
    return tensors


def _median(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        fn()
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
