"""Throughput and MFU of the Megatron train step (slime.backends.megatron.train_step) on random Qwen2 models.

    python bench/train_step.py --model 0.5b --seq 1024 --global-batch 16 --micro-batch 4
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1 --lora-rank 64

Builds a random-weight Qwen2 of the named size through mbridge (bf16 params, fp32 master weights and
gradients, Adam), then times full SFT train steps (every token but the first is a loss token) after
warm-up steps. Prints one JSON line per configuration:

* tokens/s = tokens per step (global batch x sequence) / median step time;
* MFU = 6 * params * tokens/s / peak (params counts the tied embedding once: it is the output
  layer's matmul), and `mfu_with_attention` adds the causal attention matmuls
  (6 * layers * seq * hidden per token, i.e. half of the full 12 L s h);
* peak is H100 dense bf16, 989 TFLOP/s, unless `--peak-tflops` says otherwise.
With `--lora-rank R` every linear layer gets rank-R adapters on the frozen base (docs/lora.md): the
base's weight gradients are skipped, so the same MFU formula (6 x params) overstates the work done;
compare `tokens_per_s` and `peak_mem_gib` with the full run instead.
Needs CUDA (no Ray, no Prefect).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from slime.data.random_models import QWEN2_SHAPES, qwen2_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(QWEN2_SHAPES), default="0.5b")
    parser.add_argument("--seq", type=int, nargs="+", default=[1024])
    parser.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100 dense bf16")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on every linear layer")
    parser.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x rank")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/train_step.py needs CUDA")

    from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
    from slime.backends.megatron.lora import LoraSpec, count_parameters, lora_callback
    from slime.backends.megatron.optimizer import build_optimizer
    from slime.backends.megatron.train import StepSettings, train_step
    from slime.types import Sample

    shape = QWEN2_SHAPES[args.model]
    config = qwen2_config(args.model, max_position_embeddings=32768)
    init_megatron(seed=0)
    with tempfile.TemporaryDirectory() as hf_dir:
        config.save_pretrained(hf_dir)  # mbridge needs only the config for a randomly initialised model
        bridge = make_bridge(hf_dir, torch.bfloat16)
        spec = LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha or 2.0 * args.lora_rank, dropout=0.0,
                        targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) if args.lora_rank else None
        models = build_model(bridge, wrap_with_ddp=True, post_create=lora_callback(spec))
    optimizer = build_optimizer(models, lr=1e-5, clip_grad=1.0, bf16=True)
    params = sum(p.numel() for p in models[0].parameters())
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=args.micro_batch)
    generator = torch.Generator().manual_seed(0)
    for seq in args.seq:
        samples = [Sample(index=i, tokens=torch.randint(0, config.vocab_size, (seq,), generator=generator).tolist(),
                          response_length=seq - 1) for i in range(args.global_batch)]
        times = []
        torch.cuda.reset_peak_memory_stats()
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            metrics = train_step(models, optimizer, samples, settings, vocab_size=config.vocab_size)
            torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        tokens_per_s = args.global_batch * seq / step_s
        flops_per_token = 6 * params
        attention_flops = 6 * shape["num_hidden_layers"] * seq * shape["hidden_size"]
        print(json.dumps({
            "model": args.model, "params": params, "seq": seq, "global_batch": args.global_batch,
            "micro_batch": args.micro_batch, "step_s": round(step_s, 4), "steps": args.steps,
            "lora_rank": args.lora_rank, "trainable_params": count_parameters(models)["trainable"],
            "tokens_per_s": round(tokens_per_s), "mfu": round(flops_per_token * tokens_per_s / args.peak_tflops / 1e12, 4),
            "mfu_with_attention": round((flops_per_token + attention_flops) * tokens_per_s / args.peak_tflops / 1e12, 4),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1), "loss": round(metrics["sft_loss"], 3),
            "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
