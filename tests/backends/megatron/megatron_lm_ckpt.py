"""A rank of the Megatron-LM checkpoint tests (test_megatron_lm_checkpoint.py); run through multirank.run_ranks.

    python megatron_lm_ckpt.py run    HF_DIR SAVE   steps 1..4 (TP = world size); after step 2 three saves:
                                                    SAVE/native (this project's), SAVE/mlm (as Megatron-LM writes,
                                                    `write_like_megatron_lm`), SAVE/ours_mlm (save_megatron_lm_checkpoint)
    python megatron_lm_ckpt.py resume HF_DIR SAVE   one rank: --load SAVE/mlm, then SAVE/ours_mlm, each followed by
                                                    steps 3 and 4
    python megatron_lm_ckpt.py reshard HF_DIR SAVE  one rank: the TP 2 run's SAVE/native and SAVE/mlm weights, and a
                                                    full load of SAVE/mlm at TP 1

Each prints JSON lines: sha256 of the weights and optimizer state, the lr, the loss, and draws from python, numpy
and torch made at that point (checkpoint_resume.py's `report`).
"""

import argparse
import json
import logging
import os
import random
from argparse import Namespace
from fractions import Fraction

import numpy as np
import torch
from checkpoint_resume import GLOBAL_BATCH, SAVE_AT, STEPS, digest, report, step
from multirank import rank_env

from slime.backends.megatron.bridge import build_model, close_megatron, init_megatron, make_bridge
from slime.backends.megatron.checkpoint import (
    load_checkpoint,
    load_model_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from slime.backends.megatron.megatron_lm import read_megatron_lm_checkpoint, save_megatron_lm_checkpoint
from slime.backends.megatron.optimizer import build_optimizer_and_scheduler
from slime.config import load_config


class SlimeOnlyThing:
    """Stands for an args value of a class outside megatron-core's weights-only allowlist (slime adds its own)."""

    def __init__(self, value: int) -> None:
        self.value = value


def write_like_megatron_lm(models, optimizer, scheduler, root: str, iteration: int) -> None:
    """What Megatron-LM's `save_checkpoint(iteration, model, optimizer, opt_param_scheduler, ...)` writes with
    `--ckpt-format torch_dist` (megatron/training/checkpointing.py at NVIDIA/Megatron-LM d98e8a6: `get_rng_state`,
    `_build_sharded_state_dict_metadata`, `generate_state_dict`, the `dist_checkpointing.save(...,
    content_metadata=...)` call, the tracker written after), with slime's data-source file beside it
    (slime/rollout/data_source.py `save`). Written independently of megatron_lm.py, line for line from those."""
    from megatron.core import dist_checkpointing, mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.utils import unwrap_model

    model = unwrap_model(models)
    rng_state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                 "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
                 "rng_tracker_states": get_cuda_rng_tracker().get_states()}
    rng_state_list = ShardedObject("rng_state", [rng_state],
                                   (mpu.get_pipeline_model_parallel_world_size(),
                                    mpu.get_tensor_model_parallel_world_size()),
                                   (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
                                   replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
    args = Namespace(num_layers=model[0].config.num_layers, hidden_size=model[0].config.hidden_size,
                     num_attention_heads=model[0].config.num_attention_heads, global_batch_size=GLOBAL_BATCH,
                     tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
                     pipeline_model_parallel_size=1, use_distributed_optimizer=False, ckpt_format="torch_dist",
                     params_dtype=torch.float32, attention_backend=AttnBackend.auto, no_save_optim=None,
                     no_save_rng=None, data_parallel_random_init=False, consumed_train_samples=iteration * GLOBAL_BATCH,
                     rollout_extra=SlimeOnlyThing(3), ratio=Fraction(1, 3))
    state_dict = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    state_dict["model"] = model[0].sharded_state_dict(metadata=metadata)
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata)
    state_dict["opt_param_scheduler"] = {k: v * GLOBAL_BATCH if k in ("num_steps", "lr_warmup_steps", "lr_decay_steps",
                                                                       "wd_incr_steps") else v
                                         for k, v in scheduler.state_dict().items()}  # Megatron steps by samples
    state_dict["rng_state"] = rng_state_list
    state_dict["num_floating_point_operations_so_far"] = 0
    checkpoint_name = os.path.join(root, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(checkpoint_name, exist_ok=True)
    torch.distributed.barrier()
    content_metadata = {k: v for k, v in metadata.items() if k != "dp_cp_group"}  # _clean_metadata_for_serialization
    dist_checkpointing.save(state_dict, checkpoint_name, TorchDistSaveShardedStrategy("torch_dist", 1),
                            content_metadata=content_metadata)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
        os.makedirs(os.path.join(root, "rollout"), exist_ok=True)
        torch.save({"sample_offset": 8, "epoch_id": 0, "sample_group_index": 8, "sample_index": 64, "metadata": {}},
                   os.path.join(root, "rollout", f"global_dataset_state_dict_{iteration}.pt"))
    torch.distributed.barrier()


def layout(path: str) -> dict:
    """The torch_dist keys and common.pt keys of a checkpoint directory: what Megatron-LM's loader sees."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = read_megatron_lm_checkpoint(path)
    return {"keys": sorted(FileSystemReader(path).read_metadata().state_dict_metadata),
            "common": sorted(ckpt.common), "args": sorted(ckpt.args or {}), "unread": ckpt.unread,
            "content_metadata": ckpt.content_metadata, "iteration": ckpt.iteration,
            "checkpoint_version": ckpt.common.get("checkpoint_version")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["run", "resume", "reshard"])
    parser.add_argument("hf_dir")
    parser.add_argument("save")
    args = parser.parse_args()
    _, world, _ = rank_env()
    tp = world if args.mode == "run" else 1
    rank, world, bridge, models, optimizer, scheduler = setup_tp(args.hf_dir, tp)
    if args.mode == "run":
        for k in range(1, STEPS + 1):
            loss = step(models, optimizer, scheduler, bridge, k, 0, 1)  # TP ranks: the whole batch
            if k == SAVE_AT:
                save_checkpoint(models, f"{args.save}/native", k, optimizer=optimizer, scheduler=scheduler,
                                extra_state={"cursor": k * GLOBAL_BATCH})
                write_like_megatron_lm(models, optimizer, scheduler, f"{args.save}/mlm", k)
                save_megatron_lm_checkpoint(models, f"{args.save}/ours_mlm", k, optimizer=optimizer,
                                            scheduler_state=scheduler.state_dict(), samples_per_step=GLOBAL_BATCH)
                for which in ("mlm", "ours_mlm"):
                    print(json.dumps({"layout": which, **layout(resolve_checkpoint(f"{args.save}/{which}"))}),
                          flush=True)
            report(models, optimizer, rank, k, "after step", loss=loss)
    elif args.mode == "resume":
        for which in ("mlm", "ours_mlm"):
            if which == "ours_mlm":  # a fresh model, optimizer and schedule, as a new process would have
                _, _, bridge, models, optimizer, scheduler = setup_tp(args.hf_dir, 1)
            state = load_checkpoint(models, resolve_checkpoint(f"{args.save}/{which}"), optimizer, scheduler)
            report(models, optimizer, rank, SAVE_AT, which, iteration=state.iteration, extra_state=state.extra_state)
            for k in range(SAVE_AT + 1, STEPS + 1):
                loss = step(models, optimizer, scheduler, bridge, k, 0, 1)  # TP ranks: the whole batch
                report(models, optimizer, rank, k, which, loss=loss)
    else:
        load_model_checkpoint(models, resolve_checkpoint(f"{args.save}/native"))
        native = digest(models[0].parameters())
        load_model_checkpoint(models, resolve_checkpoint(f"{args.save}/mlm"))
        print(json.dumps({"native": native, "mlm": digest(models[0].parameters())}), flush=True)
        state = load_checkpoint(models, resolve_checkpoint(f"{args.save}/mlm"), optimizer, scheduler)
        report(models, optimizer, rank, SAVE_AT, "full load at TP 1", iteration=state.iteration)


def setup_tp(hf_dir: str, tp: int):
    """checkpoint_resume.setup (Adam, warmup + cosine, fp32) with all ranks in one tensor-parallel group (DP 1)."""
    rank, world, init_method = rank_env()
    if not torch.distributed.is_initialized():
        logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")  # the load's what-carried-over line
    init_megatron(seed=7, tensor_parallel=tp, rank=rank, world_size=world, init_method=init_method)
    config = load_config(None, ["--lr", "1e-2", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
                                "--lr-warmup-init", "1e-4", "--min-lr", "1e-4", "--weight-decay", "0.01"])
    bridge = make_bridge(hf_dir)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    optimizer, scheduler = build_optimizer_and_scheduler(models, config, total_steps=8)
    return rank, world, bridge, models, optimizer, scheduler

if __name__ == "__main__":
    main()
    close_megatron()
