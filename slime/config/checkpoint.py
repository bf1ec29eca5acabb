"""Model sources and checkpoint destinations (`checkpoint:`), and the check of the flags that shape a start from
another checkpoint."""

from __future__ import annotations

import os

from pydantic import Field

from slime.config.base import ConfigTree, Fail, _Section


class CheckpointConfig(_Section):
    """Model sources and checkpoint destinations."""

    hf_checkpoint: str | None = Field(None, description="HF model dir: tokenizer, engine init, conversion source")
    model_name: str | None = None
    ref_load: str | None = Field(None, description="reference model checkpoint (KL, initial weights)")
    load: str | None = Field(None, description="checkpoint to resume from")
    save: str | None = Field(None, description="checkpoint directory; None: {store}/{run_id}/<stage>/checkpoint; "
                                               "relative: under {store}/{run_id}")
    save_interval: int | None = Field(None, ge=1, description="RL: save every N rollouts, and at the "
                                                              "end (SFT: sft_save_interval)")
    save_hf: str | None = Field(None, description="also write HF weights here when saving")
    ref_ckpt_step: int | None = Field(None, ge=0, description="load iteration N of ref_load (default: its newest "
                                                              "committed checkpoint)")
    opd_teacher_load: str | None = Field(None, description="on-policy distillation (opd_type megatron): the teacher's "
                                                           "Megatron checkpoint (a committed one or a --save root), "
                                                           "of the student's architecture and vocabulary")
    opd_teacher_ckpt_step: int | None = Field(None, ge=0, description="load iteration N of opd_teacher_load (default: "
                                                                      "its newest committed checkpoint)")
    no_save_optim: bool = Field(False, description="save the model only: no optimizer, scheduler or RNG state "
                                                   "(such a checkpoint cannot resume training)")
    no_load_optim: bool = Field(False, description="Megatron's --no-load-optim: start from the full checkpoint `load` "
                                                   "names with its weights, iteration, RNG and caller state but a fresh "
                                                   "optimizer and LR schedule (a resume of this run's own `save` stays "
                                                   "full)")
    no_load_rng: bool = Field(False, description="Megatron's --no-load-rng: start from the full checkpoint `load` names "
                                                 "without its RNG state (the generators keep run.seed's)")
    finetune: bool = Field(False, description="Megatron's --finetune: take only the weights of the checkpoint `load` "
                                              "names: iteration 0, fresh optimizer, schedule and data cursor (a resume "
                                              "of this run's own `save` stays full)")
    dist_ckpt_optim_fully_reshardable: bool = Field(
        False, description="DistributedOptimizer state as 'fully_reshardable' (any parallel layout can load it) "
                           "instead of 'dp_reshardable' (same TP/PP)")
    async_save: bool = Field(False, description="slime's/Megatron's --async-save: a save copies the state to host "
                                                "memory and training goes on while background processes write it; "
                                                "committed once every rank's files are durable (a crash mid-write "
                                                "leaves the previous checkpoint the newest)")
    keep_checkpoints: int | None = Field(None, ge=1, description="keep only the newest N committed checkpoints under "
                                                                 "`save` (older ones are deleted after each commit; "
                                                                 "verl's max_actor_ckpt_to_keep, OpenRLHF's "
                                                                 "--max_ckpt_num); None: keep every one")


def check_load_flags(config: ConfigTree, fail: Fail) -> None:
    """--finetune / --no-load-optim / --no-load-rng shape the start from the checkpoint `load` names; `save`
    holds this run's own checkpoints, which always resume in full (the resume promise; docs/rl.md "Starting from
    another checkpoint"), so the two must differ (Megatron-LM scripts often pass one directory as both)."""
    ck = config.checkpoint
    given = [name for name in ("finetune", "no_load_optim", "no_load_rng") if getattr(ck, name)]
    if not (given and ck.load and ck.save) or not ("://" in ck.save or os.path.isabs(ck.save)):
        return  # a relative save lies under {store}/{run_id}: a run directory of its own

    def norm(path: str) -> str:
        return path.rstrip("/") if "://" in path else os.path.normpath(os.path.abspath(path))

    load, save = norm(ck.load), norm(ck.save)
    if load == save or load.startswith(save + "/"):
        fail(f"checkpoint.{given[0]}", f"--{given[0].replace('_', '-')} applies to the checkpoint --load names when "
             "the run starts from it, but --save is the same directory: its checkpoints are this run's own and "
             "resume in full after a restart. Give --save a directory of its own", "checkpoint.load",
             "checkpoint.save")
