"""Stage `sft`: supervised fine-tuning (cold start) of a Megatron model on chat conversations.

    slime sft --hf-checkpoint runs/tiny-kit/model --sft-data runs/tiny-kit/data/sft.jsonl \\
              --save runs/exp/sft/checkpoint [--load runs/exp/convert/checkpoint] \\
              --global-batch-size 64 --micro-batch-size 16 --lr 1e-3 --sft-num-epoch 2
    python -m slime.sft --config deployments/tiny-cpu.yaml

The loss is the token mean over assistant tokens only (multi-turn masks from the chat template,
`slime.data.sft`), reduced per sample or per token (`--calculate-per-token-loss`). Each epoch visits
the conversations in a seeded order in steps of `global_batch_size` (a last partial step is dropped,
as in slime). Weights start from `--load` (a converted checkpoint) when given, else from the HF
checkpoint. The result is committed as iteration N = number of steps under `--save`.
Not yet: optimizer state in the checkpoint (so an interrupted SFT restarts its optimizer), data
parallelism and LR schedules.
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any

from slime.config import Config

logger = logging.getLogger(__name__)


def run_sft(config: Config) -> dict[str, Any]:
    """Fine-tune on `sft.sft_data`; returns the checkpoint path, its hash and the loss curve."""
    config.require("checkpoint.hf_checkpoint", "sft.sft_data", "checkpoint.save", stage="sft")
    from transformers import AutoTokenizer

    from slime.backends.megatron.bridge import build_model, checkpoint_metadata, init_megatron, make_bridge
    from slime.backends.megatron.checkpoint import iteration_dir, load_model_checkpoint, save_model_checkpoint
    from slime.backends.megatron.optimizer import build_optimizer
    from slime.backends.megatron.train import StepSettings, train_step
    from slime.convert import megatron_dtype
    from slime.data.sft import load_sft_samples
    from slime.export import resolve_checkpoint
    from slime.storage import manifest_hash

    hf_dir = config.checkpoint.hf_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    samples = load_sft_samples(config.sft.sft_data, tokenizer, messages_key=config.sft.messages_key,
                               tool_key=config.data.tool_key)
    batch_size = config.train.global_batch_size or len(samples)
    if batch_size > len(samples):
        batch_size = len(samples)
        logger.warning("global_batch_size exceeds the %d conversations: using %d", len(samples), batch_size)
    init_megatron(seed=config.run.seed)
    bridge = make_bridge(hf_dir, megatron_dtype(config))
    models = build_model(bridge, wrap_with_ddp=True)
    if config.checkpoint.load:
        load_model_checkpoint(models, resolve_checkpoint(config.checkpoint.load))
    else:
        bridge.load_weights(models, hf_dir)
    optimizer = build_optimizer(models, lr=config.train.lr, clip_grad=config.train.clip_grad,
                                bf16=bool(config.megatron.get("bf16")))
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=config.train.micro_batch_size,
                            calculate_per_token_loss=config.algorithm.calculate_per_token_loss)
    rng = random.Random(config.run.seed)
    losses: list[float] = []
    for epoch in range(config.sft.sft_num_epoch):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            batch = [samples[i] for i in order[start : start + batch_size]]
            metrics = train_step(models, optimizer, batch, settings, vocab_size=bridge.hf_config.vocab_size,
                                 pad_token_id=tokenizer.pad_token_id or 0)
            losses.append(metrics["sft_loss"])
            logger.info("sft epoch %d step %d loss %.4f grad_norm %.3f", epoch, len(losses), metrics["sft_loss"],
                        metrics["grad_norm"])
    save_model_checkpoint(models, config.checkpoint.save, len(losses),
                          config_hash=config.section_hash("sft", "train", "checkpoint", "megatron"),
                          metadata={**checkpoint_metadata(bridge, hf_dir), "stage": "sft", "sft_losses": losses})
    path = iteration_dir(config.checkpoint.save, len(losses))
    return {"checkpoint": path, "manifest_hash": manifest_hash(path), "steps": len(losses),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}


if __name__ == "__main__":
    from slime.cli import main

    sys.exit(main(["sft", *sys.argv[1:]]))
