"""A kit's pretrained base: a short next-token pretraining of the kit's random model on another task.

LoRA adapts a model that already has meaningful token embeddings and output layer: it freezes both.
A kit's random init has neither, and on it LoRA cannot learn the kit's task (measured on the tiny kit:
after 62 SFT steps the loss is 1.43 with full fine-tuning, 3.2-3.9 with LoRA, and 3.15 with full
fine-tuning and only the tied embedding frozen). A recipe's `pretrain:` section therefore trains the
kit's model, before it is saved, on conversations of a *different* arithmetic task (by default
subtraction, where the kit's task is addition): the base then knows the digits and the chat format but
not the task, as a real base model does, and untrained accuracy on the task stays near 0.

This is the pretraining that produced the base, outside the post-training pipeline, so it is a plain
PyTorch loop over the HF model (AdamW, next-token loss on the whole conversation), seeded from the
recipe. Deterministic on one machine; across machines the float results may differ in the last bits.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from tqdm.auto import tqdm

from slime.data.arithmetic import draw_problem

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)


class PretrainRecipe(BaseModel):
    """How the kit's base is pretrained (`pretrain:` of a kit recipe)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["-"], min_length=1)
    digits: list[Annotated[int, Field(ge=1, le=15)]] = Field(default_factory=lambda: [2], min_length=1)
    num_examples: int = Field(4000, gt=0)
    epochs: int = Field(3, gt=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)


def pretraining_conversations(recipe: PretrainRecipe, seed: int) -> list[list[dict[str, str]]]:
    """`num_examples` chat conversations of the pretraining task (bare answers, as the tiny kit's SFT), its
    problems drawn as the kit draws its own (`slime.data.arithmetic`)."""
    rng = random.Random(f"{seed}:pretrain")
    conversations = []
    for _ in range(recipe.num_examples):
        row = draw_problem(rng, rng.choice(recipe.digits), recipe.ops)
        conversations.append([{"role": "user", "content": row["prompt"]},
                              {"role": "assistant", "content": row["label"]}])
    return conversations


def pretrain(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, recipe: PretrainRecipe,
             seed: int) -> float:
    """Train `model` in place on the pretraining task; the mean loss of the last epoch."""
    import torch

    rows = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=False) for c in
            pretraining_conversations(recipe, seed)]
    pad = tokenizer.pad_token_id
    order = random.Random(f"{seed}:pretrain-order")
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    steps_per_epoch = -(-len(rows) // recipe.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / recipe.warmup_steps) if recipe.warmup_steps else 1.0)
    model.train()
    last_epoch: list[float] = []
    progress = tqdm(total=recipe.epochs * steps_per_epoch, desc="pretraining the kit's base", unit="step",
                    disable=None)  # shown on a terminal only
    with torch.random.fork_rng(devices=[]), progress:
        torch.manual_seed(seed)
        for epoch in range(recipe.epochs):
            indices = list(range(len(rows)))
            order.shuffle(indices)
            last_epoch = []
            for step in range(steps_per_epoch):
                batch = [rows[i] for i in indices[step * recipe.batch_size:(step + 1) * recipe.batch_size]]
                width = max(len(r) for r in batch)
                ids = torch.full((len(batch), width), pad, dtype=torch.long)
                labels = torch.full((len(batch), width), -100, dtype=torch.long)  # padding is not a target
                for i, r in enumerate(batch):
                    ids[i, :len(r)] = torch.tensor(r)
                    labels[i, :len(r)] = torch.tensor(r)
                loss = model(input_ids=ids, labels=labels).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                last_epoch.append(float(loss))
                progress.update()
                progress.set_postfix(loss=f"{last_epoch[-1]:.3f}")
            logger.info("kit base pretraining: epoch %d/%d, mean loss %.4f", epoch + 1, recipe.epochs,
                        sum(last_epoch) / len(last_epoch))
    model.eval()
    return sum(last_epoch) / len(last_epoch)
