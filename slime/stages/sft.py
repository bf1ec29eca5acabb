"""Stage `sft`: supervised fine-tuning (cold start) of a Megatron model on chat conversations.

    slime sft --hf-checkpoint runs/tiny-kit/model --sft-data runs/tiny-kit/data/sft.jsonl \\
              --save runs/exp/sft/checkpoint [--load runs/exp/convert/checkpoint] \\
              --global-batch-size 64 --micro-batch-size 16 --lr 1e-3 --sft-num-epoch 2 \\
              [--lr-decay-style cosine --lr-warmup-iters 10 --save-interval 50]
    python -m slime.stages.sft --config deployments/tiny-cpu.yaml

The loss is the token mean over assistant tokens only (multi-turn masks from the chat template,
`slime.data.sft`), reduced per sample or per token (`--calculate-per-token-loss`). Each epoch visits
the conversations in a seeded order in steps of `global_batch_size` (a last partial step is dropped,
as in slime). Optimizer and LR schedule come from the `train:` section (`build_optimizer_and_scheduler`;
the schedule's length defaults to the stage's total steps). Weights start from `--load` (a converted
checkpoint, model only) when given, else from the HF checkpoint. That start is always what Megatron's
`--finetune` asks for (weights only, step 0, fresh optimizer), so `--finetune`, `--no-load-optim` and
`--no-load-rng` change nothing here; they never apply to the resume from `--save` below.

Checkpoints: every `sft_save_interval` optimizer steps and at the end, the full training state (model,
optimizer, scheduler, RNG, loss curve) is committed as iteration N = steps done under `--save`
(`--no-save-optim`: the model only). Whether `--save` may be resumed is decided first by its record
(slime/stages/record.py: same settings, or refused naming the fields); then the stage resumes from the
newest committed checkpoint at the exact next step (same data order: the epoch orders are replayed from
the seed), so an interrupted SFT ends with the weights an uninterrupted one would have; a `--save`
that holds the final iteration returns it without training. The data plan in the checkpoint is checked
again here (data, batch size, seed, number of steps), and a resume from a model-only (`--no-save-optim`)
checkpoint is refused.
Not yet: data parallelism (one rank).
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any

from slime.config import Config
from slime.errors import ConfigError
from slime.storage.staging import staged

logger = logging.getLogger(__name__)


def run_sft(config: Config) -> dict[str, Any]:
    """Fine-tune on `sft.sft_data`; returns the checkpoint path, its hash and the loss curve."""
    config.require("checkpoint.hf_checkpoint", "sft.sft_data", "checkpoint.save", stage="sft")
    with staged(config) as (local, staging):  # remote --load / --save: local copies, new checkpoints uploaded after
        result = _sft(local)
    return {**result, "checkpoint": staging.to_remote(result["checkpoint"]),
            "resumed_from": result["resumed_from"] and staging.to_remote(result["resumed_from"])}


def _sft(config: Config) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge, model_parallel_sizes
    from slime.backends.megatron.checkpoint import (
        iteration_dir,
        latest_checkpoint,
        load_checkpoint,
        load_model_checkpoint,
        resolve_checkpoint,
    )
    from slime.backends.megatron.freeze import freeze_callback
    from slime.backends.megatron.lora import LoraSpec, count_parameters, lora_callback
    from slime.backends.megatron.optimizer import build_optimizer_and_scheduler
    from slime.backends.megatron.train import StepSettings, train_step
    from slime.data.sft import load_sft_samples
    from slime.stages.convert import megatron_dtype, vocab_padding
    from slime.storage import is_committed

    hf_dir, save = config.checkpoint.hf_checkpoint, config.checkpoint.save
    config = config.model_copy(update={"train": config.sft_train()})  # sft_lr etc. (validated with the config)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    samples = load_sft_samples(config.sft.sft_data, tokenizer, messages_key=config.sft.messages_key,
                               tool_key=config.data.tool_key, loss_mask_type=config.sft.loss_mask_type)
    batch_size = config.train.global_batch_size or len(samples)
    if batch_size > len(samples):
        batch_size = len(samples)
        logger.warning("global_batch_size exceeds the %d conversations: using %d", len(samples), batch_size)
    steps_per_epoch = len(samples) // batch_size
    total_steps = steps_per_epoch * config.sft.sft_num_epoch
    # what fixes the data order: a resumed run must agree on all of it
    data_plan = {"num_conversations": len(samples), "global_batch_size": batch_size, "seed": config.run.seed,
                 "total_steps": total_steps}

    path = iteration_dir(save, total_steps)
    resume_from = latest_checkpoint(save)
    if resume_from is not None:
        saved_losses = _check_resumable(resume_from, data_plan)
        if resume_from == path:  # this SFT already finished: nothing to train
            logger.info("%s is this SFT's final checkpoint: nothing to do", path)
            return _summary(path, saved_losses, resume_from)

    model_parallel_sizes(config.megatron, 1, "the SFT stage trains on one rank")  # TP / PP > 1 refused, not ignored
    init_megatron(seed=config.run.seed, megatron=config.megatron)
    bridge = make_bridge(hf_dir, megatron_dtype(config), vocab_padding(config, hf_dir), config.megatron)
    lora_spec = LoraSpec.from_config(config)  # LoRA: adapters on the frozen base (docs/lora.md)
    models = build_model(bridge, wrap_with_ddp=True, use_distributed_optimizer=config.train.use_distributed_optimizer,
                         post_create=lora_callback(lora_spec) or freeze_callback(
                             config.train.only_train_params_name_list, config.train.freeze_params_name_list))
    optimizer, scheduler = build_optimizer_and_scheduler(models, config, total_steps)
    if lora_spec is not None:
        from slime.backends.megatron import lora_weights

        if resume_from is not None:
            lora_weights.load_base(bridge, models, lora_weights.recorded_base(resume_from))
        else:
            lora_weights.start_weights(bridge, models, config)
            optimizer.reload_model_params()
    if resume_from is not None:
        state = load_checkpoint(models, resume_from, optimizer, scheduler)
        done, losses = state.iteration, list(state.extra_state.get("sft_losses", []))
        logger.info("resumed SFT from %s at step %d", resume_from, done + 1)
    elif lora_spec is not None:
        done, losses = 0, []
    else:
        done, losses = 0, []
        if config.checkpoint.load:
            load_model_checkpoint(models, resolve_checkpoint(config.checkpoint.load))
        else:
            bridge.load_weights(models, hf_dir)
        # bf16/fp16: the optimizer's fp32 main params were copied from the model when it was built (Megatron's
        # random init); refresh them from the loaded weights, or the first step writes the init back
        optimizer.reload_model_params()

    saver = None
    if config.checkpoint.async_save:  # interim saves written in the background (docs/megatron.md)
        from slime.backends.megatron.async_save import AsyncSaver

        saver = AsyncSaver()

    def save_at(step: int) -> None:
        _save(config, bridge, models, optimizer, scheduler, step, losses, data_plan, saver)

    settings = StepSettings(loss_type="sft_loss", micro_batch_size=config.train.micro_batch_size,
                            calculate_per_token_loss=config.algorithm.calculate_per_token_loss)
    order_rng = random.Random(config.run.seed)
    step = 0
    for epoch in range(config.sft.sft_num_epoch):
        order = list(range(len(samples)))
        order_rng.shuffle(order)  # drawn for every epoch, also the finished ones: resume replays the orders
        for start in range(0, steps_per_epoch * batch_size, batch_size):
            step += 1
            if step <= done:
                continue
            batch = [samples[i] for i in order[start : start + batch_size]]
            metrics = train_step(models, optimizer, batch, settings, vocab_size=bridge.hf_config.vocab_size,
                                 pad_token_id=tokenizer.pad_token_id or 0)
            scheduler.step(1)
            if saver is not None:
                saver.poll()
            losses.append(metrics["sft_loss"])
            logger.info("sft epoch %d step %d/%d loss %.4f grad_norm %.3f lr %.3g", epoch, step, total_steps,
                        metrics["sft_loss"], metrics["grad_norm"], metrics["lr"])
            interval = config.sft.sft_save_interval
            if interval and step % interval == 0 and step < total_steps:
                save_at(step)
    if not is_committed(path):
        save_at(total_steps)
    if saver is not None:
        saver.close()  # the last save committed before the stage reports it
    summary = _summary(path, losses, resume_from)
    if lora_spec is not None:
        counts = count_parameters(models)
        summary.update(lora_rank=lora_spec.rank, trainable_params=counts["trainable"], total_params=counts["total"])
    return summary


def _summary(path: str, losses: list[float], resumed_from: str | None) -> dict[str, Any]:
    from slime.storage import manifest_hash

    return {"checkpoint": path, "manifest_hash": manifest_hash(path), "steps": len(losses),
            "resumed_from": resumed_from, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None}


def _check_resumable(path: str, data_plan: dict[str, Any]) -> list[float]:
    """Refuse to continue from `path` unless it is an SFT checkpoint of the same data plan (which fixes
    the data order); returns its loss curve."""
    from slime.backends.megatron.checkpoint import read_checkpoint_manifest

    meta = read_checkpoint_manifest(path).metadata
    if meta.get("stage") != "sft":
        raise ConfigError(f"--save holds {path}, a checkpoint of stage {meta.get('stage')!r}: SFT resumes only its "
                          "own checkpoints; give SFT its own --save directory (and the other one as --load)")
    saved_plan = meta.get("sft_plan") or {}
    for name, value in data_plan.items():
        if saved_plan.get(name) != value:
            raise ConfigError(f"{path}: cannot resume SFT: {name} was {saved_plan.get(name)!r}, now {value!r} (the "
                              "data order would differ); use the same data and batch size, or a new --save directory")
    return list(meta.get("sft_losses", []))


def _save(config: Config, bridge: Any, models: list[Any], optimizer: Any, scheduler: Any, step: int,
          losses: list[float], data_plan: dict[str, Any], saver: Any = None) -> None:
    from slime.backends.megatron.bridge import checkpoint_metadata
    from slime.backends.megatron.checkpoint import save_checkpoint

    full = not config.checkpoint.no_save_optim
    save_checkpoint(models, config.checkpoint.save, step, optimizer=optimizer if full else None,
                    scheduler=scheduler if full else None, extra_state={"sft_losses": losses},
                    metadata={**checkpoint_metadata(bridge, config.checkpoint.hf_checkpoint), "stage": "sft",
                              "sft_losses": losses, "sft_plan": data_plan},
                    config_hash=config.section_hash("sft", "train", "checkpoint", "megatron"),
                    fully_reshardable=config.checkpoint.dist_ckpt_optim_fully_reshardable,
                    keep=config.checkpoint.keep_checkpoints, saver=saver)


if __name__ == "__main__":
    from slime.cli import main

    sys.exit(main(["sft", *sys.argv[1:]]))
