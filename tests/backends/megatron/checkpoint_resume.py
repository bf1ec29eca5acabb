"""A rank of the bit-exact resume tests (test_checkpoint_resume.py); run through multirank.run_ranks.

    python checkpoint_resume.py run    HF_DIR SAVE [--distributed SHARDING]   steps 1..N+2, saving at N
    python checkpoint_resume.py resume HF_DIR SAVE [--distributed SHARDING]   load N, steps N+1..N+2
    python checkpoint_resume.py checks HF_DIR SAVE OTHER_HF_DIR               the refusals (one rank)
    ... --lora                                                                LoRA adapters (rank 4) on the
                                                                              frozen base: adapters-only saves
    ... --fused-adam                                                          torch's fused AdamW kernel (the
                                                                              default only on CUDA)
    ... --expert-parallel N                                                   an MoE model's experts split over
                                                                              N ranks
    ... --megatron JSON                                                       megatron options for make_bridge
    resume ... --no-load-optim / --no-load-rng                                Megatron's partial loads: fresh
                                                                              optimizer and schedule / RNG

Adam with warmup + cosine (fp32, CPU) on random tokens. After every step (and right after the save /
the load) it prints one JSON line: sha256 of the weights and of the optimizer state, the learning
rate, and draws from python `random`, numpy and torch (CPU, and CUDA when present) made at that point.
"""

import argparse
import hashlib
import json
import random

import numpy as np
import torch
from multirank import rank_env

from slime.backends.megatron import lora
from slime.backends.megatron.bridge import build_model, close_megatron, init_megatron, make_bridge
from slime.backends.megatron.checkpoint import (
    CheckpointMismatchError,
    ModelOnlyCheckpointError,
    iteration_dir,
    load_checkpoint,
    load_model_checkpoint,
    save_checkpoint,
    save_model_checkpoint,
)
from slime.backends.megatron.optimizer import build_optimizer_and_scheduler
from slime.backends.megatron.train import StepSettings, train_step
from slime.config import load_config
from slime.types import Sample

SAVE_AT, STEPS, GLOBAL_BATCH = 2, 4, 4


def samples_for(step: int, vocab: int, rank: int, world: int) -> list[Sample]:
    """The global batch of `step` (same on every run), this rank's share of it."""
    generator = torch.Generator().manual_seed(1000 + step)
    batch = []
    for i in range(GLOBAL_BATCH):
        prompt, response = 3 + i % 3, 4 + i % 2
        tokens = torch.randint(0, vocab, (prompt + response,), generator=generator).tolist()
        batch.append(Sample(index=i, tokens=tokens, response_length=response, loss_mask=[1] * response))
    share = GLOBAL_BATCH // world
    return batch[rank * share : (rank + 1) * share]


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def optimizer_digest(optimizer) -> str:
    # expert parallelism chains a second optimizer for the experts (their own data-parallel group)
    inners = [chained.optimizer for chained in getattr(optimizer, "chained_optimizers", [optimizer])]
    return digest(inner.state[p][k].reshape(-1) for inner in inners for g in inner.param_groups
                  for p in g["params"] for k in sorted(inner.state[p]))


def report(models, optimizer, rank: int, step: int, where: str, **extra) -> None:
    draws = [random.random(), float(np.random.rand()), torch.rand(1).item()]
    if torch.cuda.is_available():
        draws.append(torch.rand(1, device="cuda").item())
    buffers = [b for name, b in models[0].named_buffers() if name.endswith("expert_bias")]  # GLM-4.5's router bias
    print(json.dumps({"rank": rank, "step": step, "where": where, "weights": digest(models[0].parameters()),
                      "expert_bias": digest(buffers),
                      "optimizer": optimizer_digest(optimizer), "lr": optimizer.param_groups[0]["lr"],
                      "fused": bool(optimizer.param_groups[0].get("fused")), "draws": draws, **extra}),
          flush=True)


def setup(hf_dir: str, distributed: str | None, lr: float = 1e-2, with_lora: bool = False, fused_adam: bool = False,
          expert_parallel: int = 1, megatron: dict | None = None):
    rank, world, init_method = rank_env()
    if torch.cuda.is_available():  # bit-exactness on a GPU also needs deterministic kernels
        torch.use_deterministic_algorithms(True)
    init_megatron(seed=7, rank=rank, world_size=world, init_method=init_method, expert_parallel=expert_parallel)
    config = load_config(None, ["--lr", str(lr), "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
                                "--lr-warmup-init", "1e-4", "--min-lr", "1e-4", "--weight-decay", "0.01",
                                *(["--use-distributed-optimizer"] if distributed else []),
                                *(["--fused-adam"] if fused_adam else [])])  # else the default: fused on CUDA
    bridge = make_bridge(hf_dir, megatron=megatron)
    spec = lora.LoraSpec(rank=4, alpha=8.0, dropout=0.1, targets=("linear_qkv", "linear_fc2"), seed=7)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True,
                         use_distributed_optimizer=config.train.use_distributed_optimizer,
                         post_create=lora.lora_callback(spec if with_lora else None))
    if with_lora:
        lora.set_base(models, hf_dir)
    optimizer, scheduler = build_optimizer_and_scheduler(models, config, total_steps=8)
    return rank, world, bridge, models, optimizer, scheduler


def step(models, optimizer, scheduler, bridge, k: int, rank: int, world: int) -> float:
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=1)
    metrics = train_step(models, optimizer, samples_for(k, bridge.hf_config.vocab_size, rank, world), settings,
                         vocab_size=bridge.hf_config.vocab_size)
    scheduler.step(1)
    return metrics["sft_loss"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["run", "resume", "checks"])
    parser.add_argument("hf_dir")
    parser.add_argument("save")
    parser.add_argument("other_hf_dir", nargs="?")
    parser.add_argument("--distributed", default=None, choices=["dp_reshardable", "fully_reshardable"])
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--fused-adam", action="store_true")
    parser.add_argument("--no-load-optim", action="store_true")
    parser.add_argument("--no-load-rng", action="store_true")
    parser.add_argument("--expert-parallel", type=int, default=1)
    parser.add_argument("--megatron", type=json.loads, default=None)
    args = parser.parse_args()
    rank, world, bridge, models, optimizer, scheduler = setup(args.hf_dir, args.distributed, with_lora=args.lora,
                                                              fused_adam=args.fused_adam,
                                                              expert_parallel=args.expert_parallel,
                                                              megatron=args.megatron)
    full = f"{args.save}/full"
    if args.mode == "run":
        for k in range(1, STEPS + 1):
            loss = step(models, optimizer, scheduler, bridge, k, rank, world)
            if k == SAVE_AT:
                save_checkpoint(models, full, k, optimizer=optimizer, scheduler=scheduler,
                                extra_state={"cursor": k * GLOBAL_BATCH, "buffer": [[1, 2], [3]]},
                                fully_reshardable=args.distributed == "fully_reshardable")
                if world == 1:
                    save_model_checkpoint(models, f"{args.save}/model_only", k, metadata={"stage": "test"})
            report(models, optimizer, rank, k, "after step", loss=loss)
    elif args.mode == "resume":
        state = load_checkpoint(models, iteration_dir(full, SAVE_AT), optimizer, scheduler,
                                load_optim=not args.no_load_optim, load_rng=not args.no_load_rng)
        report(models, optimizer, rank, SAVE_AT, "after step", extra_state=state.extra_state,
               iteration=state.iteration)
        for k in range(SAVE_AT + 1, STEPS + 1):
            loss = step(models, optimizer, scheduler, bridge, k, rank, world)
            report(models, optimizer, rank, k, "after step", loss=loss)
    elif args.lora:
        lora_checks(args, models)
    else:
        checks(args, bridge, models, optimizer)


def lora_checks(args, models) -> None:
    """A LoRA checkpoint on another base, and in a model without adapters, are refused."""
    def attempt(name: str, fn) -> None:
        try:
            fn()
            print(json.dumps({"check": name, "error": None}), flush=True)
        except Exception as exc:  # the test asserts on the type and message
            print(json.dumps({"check": name, "error": type(exc).__name__, "message": str(exc)}), flush=True)

    path = iteration_dir(f"{args.save}/full", SAVE_AT)
    attempt("same base", lambda: load_model_checkpoint(models, path))
    lora.set_base(models, args.other_hf_dir)
    attempt("other base", lambda: load_model_checkpoint(models, path))
    plain = build_model(make_bridge(args.hf_dir))
    attempt("model without adapters", lambda: load_model_checkpoint(plain, path))


def checks(args, bridge, models, optimizer) -> None:
    """Model-only load and the refusals, each printed as {"check": ..., "error": type, "message": ...}."""
    def attempt(name: str, fn) -> None:
        try:
            fn()
            print(json.dumps({"check": name, "error": None}), flush=True)
        except Exception as exc:  # the test asserts on the type and message
            print(json.dumps({"check": name, "error": type(exc).__name__, "message": str(exc),
                              "is_config_error": isinstance(exc, ValueError)}), flush=True)

    model_only = iteration_dir(f"{args.save}/model_only", SAVE_AT)
    attempt("full resume of a model-only checkpoint", lambda: load_checkpoint(models, model_only, optimizer))
    load_model_checkpoint(models, model_only)
    print(json.dumps({"check": "model-only load", "weights": digest(models[0].parameters())}), flush=True)
    # a schedule that differs from the saved one (peak lr) is refused, naming the field
    _, _, models2, optimizer2, scheduler2 = setup_again(args.hf_dir, lr=5e-3)
    attempt("resume with another lr", lambda: load_checkpoint(models2, iteration_dir(f"{args.save}/full", SAVE_AT),
                                                             optimizer2, scheduler2))
    other = make_bridge(args.other_hf_dir)
    attempt("other architecture", lambda: load_model_checkpoint(build_model(other), model_only))
    assert isinstance(CheckpointMismatchError("x"), ValueError) and issubclass(ModelOnlyCheckpointError, ValueError)


def setup_again(hf_dir: str, lr: float):
    """A second model + optimizer + scheduler in the same (already initialised) process."""
    config = load_config(None, ["--lr", str(lr), "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
                                "--lr-warmup-init", "1e-4", "--min-lr", "1e-4", "--weight-decay", "0.01"])
    bridge = make_bridge(hf_dir)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    optimizer, scheduler = build_optimizer_and_scheduler(models, config, total_steps=8)
    return 0, 1, models, optimizer, scheduler


if __name__ == "__main__":
    main()
    close_megatron()
