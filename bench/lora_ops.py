"""Operator counts of one Megatron train step on the CPU, with and without LoRA (issue 18: the adapted step is
launch-bound on a GPU, so the kernels a step issues are what to cut).

    python bench/lora_ops.py --layers 4 --lora-rank 64 --global-batch 8 --seq 32
    python bench/lora_ops.py --layers 2 --lora-rank 64 --global-batch 8 --seq 32   # per layer: the difference

Builds a random Qwen2 with the 1.5B layer shape (hidden 1536, FFN 8960) but few layers and a 1024-token
vocabulary through mbridge, as bench/train_step.py does (bf16 params, fp32 master weights, Adam, DDP, adapters
on every linear layer with alpha 2 x rank), runs a warm-up step, then profiles one SFT step with torch.profiler
and prints one JSON line:

* `dispatched`: top-level aten ops (what the host calls into the dispatcher; views included);
* `kernels`: ops that do work, each the outermost op of its call that is not a view, an allocation or a
  composite wrapper (`aten::linear` -> `aten::mm` counts once; the copies the CPU's mm makes of transposed
  operands, which cuBLAS does not need, sit inside mm and are not counted): about one GPU kernel each. An
  out-of-place `addmm` with beta 1 is one here and two on a GPU (a copy, then the GEMM);
* `backward_kernels`, `optimizer_kernels` (megatron's whole `optimizer.step()`: grad copies, clip, Adam) and
  `host_syncs` (`.item()`-like reads: a GPU->host synchronisation each).

The CPU optimizer runs torch Adam's per-parameter loop where CUDA takes its multi-tensor (foreach) path, so
optimizer counts are the CPU's. Per-layer figures are the difference of two layer counts. Time it on a GPU
with bench/train_step.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import Qwen2Config

from slime.data.random_models import QWEN2_SHAPES

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


# aten ops that only make views or allocate: no kernel on a GPU
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "t", "transpose", "reshape", "view", "view_as", "_unsafe_view", "detach", "alias", "expand", "expand_as", "slice",
    "narrow", "permute", "unsqueeze", "squeeze", "select", "as_strided", "chunk", "split", "split_with_sizes", "unbind",
    "empty", "empty_like", "empty_strided", "to", "lift_fresh", "resolve_conj", "resolve_neg", "numpy_T", "contiguous",
    "_reshape_alias", "unflatten", "flatten", "is_nonzero", "result_type", "set_", "resize_", "_local_scalar_dense",
    "item", "detach_", "requires_grad_", "_has_compatible_shallow_copy_type", "dim", "size", "stride", "is_same_size",
    "zeros_like", "ones_like", "full_like"))


# composite aten ops that only call others (their children are what runs)
COMPOSITE = frozenset(f"aten::{n}" for n in (
    "linear", "matmul", "einsum", "dropout", "rms_norm", "cross_entropy_loss", "nll_loss_nd", "softmax", "log_softmax",
    "scaled_dot_product_attention", "norm", "type_as", "float", "bfloat16", "masked_fill"))


def step_ops(prof: profile) -> dict[str, collections.Counter]:
    """The top-level aten ops (what the host dispatches), and the ops that do work: the outermost op of each call
    that is not a view, an allocation or a composite wrapper (about one GPU kernel each; the copies the CPU's
    mm makes of transposed operands, which cuBLAS does not need, are inside mm and not counted)."""
    out = {key: collections.Counter() for key in ("dispatched", "kernels", "backward_kernels", "optimizer_kernels",
                                                  "host_syncs")}
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                ancestors.append(parent.name)
            parent = parent.cpu_parent
        if not ancestors:
            out["dispatched"][event.name] += 1
        if event.name == "aten::_local_scalar_dense":  # .item(), float(), bool() of a tensor: a GPU->host sync
            out["host_syncs"][event.name] += 1
        passthrough = NO_KERNEL | COMPOSITE
        if event.name in passthrough or any(name not in passthrough for name in ancestors):
            continue
        out["kernels"][event.name] += 1
        if _under(event, ("Backward", "backward")):
            out["backward_kernels"][event.name] += 1
        if _under(event, ("optimizer_step",)):
            out["optimizer_kernels"][event.name] += 1
    return out


def _under(event: Any, marks: tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if any(mark in parent.name for mark in marks):
            return True
        parent = parent.cpu_parent
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=8, help="0: full fine-tuning")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--all", action="store_true", help="print every op's count")
    args = parser.parse_args()

    from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
    from slime.backends.megatron.lora import LoraSpec, lora_callback
    from slime.backends.megatron.optimizer import build_optimizer
    from slime.backends.megatron.train import StepSettings, train_step
    from slime.types import Sample

    torch.set_num_threads(1)
    config = Qwen2Config(**{**QWEN2_SHAPES["1.5b"], "num_hidden_layers": args.layers, "vocab_size": 1024})
    init_megatron(seed=0)
    with tempfile.TemporaryDirectory() as hf_dir:
        config.save_pretrained(hf_dir)
        bridge = make_bridge(hf_dir, torch.bfloat16)
        spec = LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank, dropout=0.0,
                        targets=TARGETS) if args.lora_rank else None
        models = build_model(bridge, wrap_with_ddp=True, post_create=lora_callback(spec))
    optimizer = build_optimizer(models, lr=1e-5, clip_grad=1.0, bf16=True)
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=args.micro_batch)
    generator = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, config.vocab_size, (args.seq,), generator=generator).tolist(),
                      response_length=args.seq - 1) for i in range(args.global_batch)]
    for _ in range(args.warmup):
        train_step(models, optimizer, samples, settings, vocab_size=config.vocab_size)
    step = optimizer.step

    def marked_step(*a: Any, **k: Any) -> Any:
        with record_function("optimizer_step"):
            return step(*a, **k)

    optimizer.step = marked_step  # the optimizer's share of the count (megatron's whole step: grads, clip, Adam)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        metrics = train_step(models, optimizer, samples, settings, vocab_size=config.vocab_size)
    ops = step_ops(prof)
    micro = args.global_batch // args.micro_batch
    adapted = 4 * args.layers if args.lora_rank else 0
    print(json.dumps({
        "layers": args.layers, "lora_rank": args.lora_rank, "micro_batches": micro, "adapted_layers": adapted,
        **{key: sum(counter.values()) for key, counter in ops.items()},
        "sft_loss": round(metrics["sft_loss"], 4), "grad_norm": metrics["grad_norm"], "top_kernels": ops["kernels"].most_common(12),
        "top_optimizer": ops["optimizer_kernels"].most_common(8), **({"all_kernels": dict(ops["kernels"]), "all_dispatched": dict(ops["dispatched"])} if args.all else {})}), flush=True)


if __name__ == "__main__":
    main()
