"""SFT learning curve of a generated kit: held-out greedy accuracy by optimizer step, in plain PyTorch.

A kit's SFT recipe (data size, steps, learning rate) decides where the pipeline's SFT stage lands, and
RL can only show its worth from a policy that is right part of the time. This trains the kit's random
model on its SFT conversations (loss on the assistant tokens, AdamW, bf16 autocast on CUDA, linear
warmup then constant) and, every `--eval-every` steps, decodes the eval prompts greedily and scores the
last `\\boxed{}` (or the bare answer) against the label, per digit tier. It is a stand-in for the
Megatron SFT stage (same model, data, optimizer and schedule) that runs in seconds per point, for
sizing a kit's SFT (docs/benchmarks.md says how `deployments/gpu-small.yaml` was sized).

    python bench/sft_curve.py --kit runs/gpu-kit --lr 1e-3 --batch 256 --steps 2000 --eval-every 250
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime.data.sft import conversation_sample
from slime.rollout.rewards.boxed import last_boxed


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def batches(samples: list, batch: int, seed: int):
    """Endless shuffled epochs of `batch` samples."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(samples)))
        rng.shuffle(order)
        for i in range(0, len(order) - batch + 1, batch):
            yield [samples[j] for j in order[i:i + batch]]


def collate(chunk: list, pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids `[B, T]` and labels `[B, T]`: the ids on the assistant tokens, -100 elsewhere
    (the model shifts them by one itself)."""
    width = max(len(s.tokens) for s in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    labels = torch.full((len(chunk), width), -100, dtype=torch.long)
    for row, s in enumerate(chunk):
        n, start = len(s.tokens), len(s.tokens) - s.response_length
        ids[row, :n] = torch.tensor(s.tokens)
        target = torch.tensor(s.tokens[start:])
        target[torch.tensor(s.loss_mask) == 0] = -100
        labels[row, start:n] = target
    return ids.to(device), labels.to(device)


@torch.no_grad()
def accuracy(model, tokenizer, rows: list[dict], max_new: int, device: torch.device) -> dict[str, float]:
    """Greedy accuracy per digit tier (and overall) on the eval rows."""
    # token ids straight from the template, as the engines get them (re-tokenizing the rendered text would
    # split the special tokens into bytes)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"] for r in rows]
    hits: dict[str, list[int]] = defaultdict(list)
    model.eval()
    for i in range(0, len(rows), 256):
        chunk = prompts[i:i + 256]
        width = max(map(len, chunk))  # left-padded
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for row, seq in zip(rows[i:i + 256], out[:, width:], strict=True):
            text = tokenizer.decode(seq, skip_special_tokens=True)
            answer = last_boxed(text)
            ok = int((answer if answer is not None else text.strip()) == row["label"])
            hits[f"digits{row['metadata']['digits']}"].append(ok)
            hits["all"].append(ok)
    model.train()
    return {k: sum(v) / len(v) for k, v in sorted(hits.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kit", type=Path, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-rows", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, help="write the curve as JSON here")
    a = p.parse_args()

    torch.manual_seed(a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(a.kit / "model")
    model = AutoModelForCausalLM.from_pretrained(a.kit / "model", dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    sft = [conversation_sample(r["messages"], tokenizer, index=i, where=f"sft:{i}")
           for i, r in enumerate(load_jsonl(a.kit / "data" / "sft.jsonl"))]
    eval_rows = load_jsonl(a.kit / "data" / "eval.jsonl")[: a.eval_rows]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=a.weight_decay,
                            fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(a.warmup, 1)))
    curve, t0, feed = [], time.monotonic(), batches(sft, a.batch, a.seed)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {len(sft)} conversations "
          f"({len(sft) / a.batch:.0f} steps an epoch), lr {a.lr}, batch {a.batch}")
    for step in range(1, a.steps + 1):
        ids, labels = collate(next(feed), tokenizer.pad_token_id, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % a.eval_every == 0 or step == a.steps:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                acc = accuracy(model, tokenizer, eval_rows, a.max_new_tokens, device)
            point = {"step": step, "epoch": step * a.batch / len(sft), "loss": loss.item(),
                     "seconds": time.monotonic() - t0, **acc}
            curve.append(point)
            print(json.dumps(point), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "curve": curve}, indent=1))


if __name__ == "__main__":
    main()
