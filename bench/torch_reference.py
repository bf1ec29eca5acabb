"""The plain-PyTorch training reference for bench/train_step.py: HF Qwen2 in bf16, SDPA, fused AdamW.

    python bench/torch_reference.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1
    python bench/torch_reference.py --model 0.5b --seq 1024 --global-batch 16 --micro-batch 4 --no-grad-checkpointing

What the Megatron train step is measured against (issue 17): a random-weight `Qwen2ForCausalLM` of the
named size (`slime.data.random_models.qwen2_config`), bf16 parameters (no fp32 master copy),
`attn_implementation="sdpa"`, gradient checkpointing (on by default, as the reference measured in
research/gpu.md), `torch.optim.AdamW(fused=True)`, gradient clipping at 1.0 as the Megatron step does.
A step is `global_batch / micro_batch` forward/backward passes of full-sequence next-token loss (HF's
own shifted cross entropy), gradients accumulated, then one optimizer step. Same CLI shape, timing
(median of `--steps` after `--warmup`) and JSON fields as bench/train_step.py, and the same MFU formula
(`bench/mfu.py`). Needs CUDA; `--device cpu` exists only so that a test can run the loop on a tiny shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from mfu import add_step_arguments, mfu_fields

from slime.data.random_models import QWEN2_SHAPES, qwen2_config


def build(config: Any, device: torch.device, grad_checkpointing: bool, dtype: torch.dtype = torch.bfloat16,
          fused: bool | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The random-weight HF model on `device` (created there, in `dtype`) and its AdamW, fused unless `fused` is
    False (default: on CUDA; torch's fused AdamW has a CPU kernel too, which the CPU benches ask for)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda" if fused is None else fused)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               micro_batch: int) -> float:
    """One optimizer step on `tokens` [global_batch, seq]: micro-batches accumulate the gradient of the
    mean next-token loss; returns that loss."""
    chunks = tokens.split(micro_batch)
    total = torch.zeros((), device=tokens.device)
    for chunk in chunks:
        loss = model(input_ids=chunk, labels=chunk).loss / len(chunks)
        loss.backward()
        total += loss.detach()  # read once after the step: a read per micro-batch would wait for the GPU each time
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    parser.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for tests (tiny shapes)")
    args = parser.parse_args()
    if args.global_batch % args.micro_batch:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of --micro-batch {args.micro_batch}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/torch_reference.py needs CUDA (--device cpu is for tests only)")

    shape = QWEN2_SHAPES[args.model]
    config = qwen2_config(args.model, max_position_embeddings=32768)
    torch.manual_seed(0)
    model, optimizer = build(config, device, args.grad_checkpointing)
    params = sum(p.numel() for p in model.parameters())  # the tied embedding once
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(0)
    for seq in args.seq:
        tokens = torch.randint(0, config.vocab_size, (args.global_batch, seq), generator=generator).to(device)
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for step in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = train_step(model, optimizer, tokens, args.micro_batch)
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        tokens_per_s = args.global_batch * seq / step_s
        print(json.dumps({
            "model": args.model, "params": params, "seq": seq, "global_batch": args.global_batch,
            "micro_batch": args.micro_batch, "step_s": round(step_s, 4), "steps": args.steps,
            "grad_checkpointing": args.grad_checkpointing, "tokens_per_s": round(tokens_per_s),
            **mfu_fields(params, shape["num_hidden_layers"], shape["hidden_size"], seq, tokens_per_s,
                         peak_tflops=args.peak_tflops),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
            "loss": round(loss, 3), "device": torch.cuda.get_device_name() if cuda else "cpu"}), flush=True)


if __name__ == "__main__":
    main()
