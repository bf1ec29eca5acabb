"""A bf16 train rank (slime.ray.train_actor.TrainActor, without Ray) through the colocated cycle.

    python tests/backends/megatron/train_actor_cycle.py MODEL_DIR WORK_DIR           # the cycle, then a save
    python tests/backends/megatron/train_actor_cycle.py MODEL_DIR WORK_DIR --load     # resume it, one step

Prints one JSON row for an offload/onload round trip and one per train step (each step preceded by an
offload/onload, as the RL loop does when colocated): the learning rate and the largest weight change
from the loaded weights; the trained rank is saved to WORK_DIR/ckpt. With --load, a rank started from
that checkpoint (`checkpoint.load`) trains one step and prints its KL to the reference model, which
must be the loaded policy, with the rollout it starts at, its Adam step count before training and the
step's learning rate. Offload and onload are no-ops on CPU.

    ... --load --finetune         Megatron's --finetune: the checkpoint's weights only
    ... --load --no-load-optim    Megatron's --no-load-optim: all of it but the optimizer and LR schedule

    ... --lora    the same with LoRA adapters (rank 4) on the frozen base: step rows also carry the KL to the
                  reference (the base, or the loaded adapters) and the trainable / total parameter counts
"""

import json
import socket
import sys
from pathlib import Path

import torch

from slime.backends.megatron.bridge import export_hf_weights
from slime.config import Config
from slime.ray.train_actor import TrainActor
from slime.storage import write_samples
from slime.types import Sample, Status


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(actor: TrainActor) -> dict[str, torch.Tensor]:
    return {name: t.detach().float().cpu().clone() for name, t in export_hf_weights(actor.bridge, actor.models)}


def rollout(uri: str, groups: int, n: int, advantage: float | None = None) -> None:
    """`groups` groups of `n` samples with rewards that differ inside each group (non-zero advantages);
    prompt 3 + response 4 tokens; with `advantage`, each sample carries it in metadata["advantage"]."""
    samples = []
    for g in range(groups):
        for i in range(n):
            prompt, response = [65 + g, 66, 67], [48 + i % 10, 49, 50, 51]
            samples.append(Sample(group_index=g, index=g * n + i, prompt="p", tokens=prompt + response,
                                  response="r", response_length=len(response), label="1", reward=float(i % 2),
                                  loss_mask=[1] * len(response), rollout_log_probs=[-1.0] * len(response),
                                  status=Status.COMPLETED,
                                  metadata={} if advantage is None else {"advantage": advantage}))
    write_samples(uri, samples)


def adam_steps(actor: TrainActor) -> float:
    """The largest `step` count over Adam's per-parameter state (0 for a fresh optimizer)."""
    inners = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    return max((float(state["step"]) for inner in inners for state in inner.optimizer.state.values()
                if "step" in state), default=0.0)


def cuda_fixed_bytes() -> int:
    """What CUDA holds before any model exists, once a bf16 and an fp32 matmul have run on the default stream:
    cuBLAS's workspaces come from the caching allocator and stay (32 MiB on Hopper), whatever the model size."""
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.ones(64, 64, device="cuda", dtype=dtype)
        (x @ x).sum().item()
    del x
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def largest_live(count: int = 4) -> list[dict]:
    """The largest allocations still live, each with the innermost Python frames that made it (memory history
    is recorded from the start of the script on CUDA): what a failed offload check left on the GPU."""
    live = [block for segment in torch.cuda.memory._snapshot()["segments"] for block in segment["blocks"]
            if block["state"] == "active_allocated"]
    live.sort(key=lambda block: -block["size"])
    return [{"bytes": block["size"],
             "frames": [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
                        for f in block.get("frames", []) if f["filename"].endswith(".py")][:4]}
            for block in live[:count]]


def main(model_dir: str, work: Path, load: bool, with_lora: bool = False, load_flags: tuple[str, ...] = ()) -> None:
    fixed = 0
    if torch.cuda.is_available() and not load:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        fixed = cuda_fixed_bytes()
    checkpoint = {"hf_checkpoint": model_dir, **({"load": str(work / "ckpt")} if load else {"save": str(work / "ckpt")}),
                  **{flag[2:].replace("-", "_"): True for flag in load_flags}}
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "cycle"}, "checkpoint": checkpoint,
        "cluster": {"colocate": True},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 3},
        "algorithm": {"use_kl_loss": True, "kl_loss_coef": 0.0},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-4, "lr_warmup_iters": 2},
        "megatron": {"bf16": True}, **({"lora": {"lora_rank": 4, "lora_alpha": 8}} if with_lora else {})})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    start = actor.init(f"tcp://127.0.0.1:{free_port()}")
    if load:
        uri = str(work / f"rollout-resumed{''.join(load_flags)}")
        rollout(uri, 4, 4)
        steps = adam_steps(actor)
        metrics = actor.train(start, uri)
        print(json.dumps({"case": "kl to reference", "start": start, "kl": metrics["rollout/kl"],
                          "adam_steps": steps, "lr": metrics["train/lr"]}), flush=True)
        return
    loaded = weights(actor)

    def moved() -> float:
        now = weights(actor)
        assert all(torch.isfinite(v).all() for v in now.values())
        return max((now[k] - loaded[k]).abs().max().item() for k in loaded)

    # what offload parks besides the DDP buffers and the optimizer: the frozen parameters (the LoRA base) and
    # the KL reference model, counted against the modules themselves
    keys = [key for key, _, _ in actor.frozen_slots()]
    frozen = sum(1 for m in actor.models for p in {id(p): p for p in m.parameters()}.values() if not p.requires_grad)
    trainable = sum(1 for m in actor.models for p in {id(p): p for p in m.parameters()}.values() if p.requires_grad)
    reference = sum(len({id(t) for t in [*m.parameters(), *m.buffers()]}) for m in actor.ref_models or [])
    offloaded = actor.offload()
    live = largest_live() if fixed else []  # while offloaded: what stayed on the GPU
    actor.onload()
    print(json.dumps({"case": "offload/onload", "moved": moved(), "frozen_slots": sum(k.startswith("frozen") for k in keys),
                      "frozen_params": frozen, "ref_slots": sum(k.startswith("ref") for k in keys), "ref_tensors": reference,
                      "policy_slots": sum(k.startswith("policy") for k in keys), "trainable_params": trainable,
                      # CUDA: what stays allocated while offloaded, against the weights of policy and reference
                      "gpu_bytes_offloaded": offloaded.get("gpu_bytes"), "frozen_bytes": offloaded.get("frozen_bytes"),
                      "gpu_bytes_fixed": fixed, "largest_live": live,
                      "model_bytes": sum(t.numel() * t.element_size() for m in [*actor.models, *(actor.ref_models or [])]
                                         for t in {id(t): t for t in m.parameters()}.values())}), flush=True)
    for step in range(3):
        uri = str(work / f"rollout{step}")
        rollout(uri, 4, 4)
        actor.offload()
        actor.onload()
        metrics = actor.train(step, uri)
        print(json.dumps({"case": f"step {step}", "lr": metrics["train/lr"], "moved": moved(),
                          **{k: v for k, v in metrics.items() if k == "rollout/kl" or k.startswith("lora/")}}),
              flush=True)
    actor.offload()
    actor.onload()
    actor.save(2, {})


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), "--load" in sys.argv[3:], "--lora" in sys.argv[3:],
         tuple(flag for flag in sys.argv[3:] if flag in ("--finetune", "--no-load-optim")))
