"""The `CheckpointIO` part of the train actor (`slime/ray/train_actor.py`)."""

from __future__ import annotations

import logging
from typing import Any

from slime.errors import ConfigError
from slime.ray.train_data import STAGE

logger = logging.getLogger(__name__)


class CheckpointIO:
    """Loading the weights a run starts from (a resume, --load, the reference, the OPD teacher) and saving
    checkpoints. Part of `TrainActor` (slime/ray/train_actor.py), whose state it uses."""

    def _load_lora_weights(self) -> int:
        """LoRA: the base, then the adapters (a resume's, else the starting ones); the KL reference stays in
        this model (slime/backends/megatron/lora_weights.py says which base, adapters and reference)."""
        from slime.backends.megatron import lora_weights
        from slime.backends.megatron.checkpoint import (
            latest_checkpoint,
            load_checkpoint,
            read_checkpoint_manifest,
        )

        c = self.config
        resume = latest_checkpoint(c.checkpoint.save) if c.checkpoint.save else None
        start_from = lora_weights.lora_checkpoint(c.checkpoint.load) if resume is None else None
        partial = {}  # --no-load-optim / --no-load-rng: for the start from `load`, as in _load_weights
        if start_from and read_checkpoint_manifest(start_from).metadata.get("stage") == STAGE and \
                read_checkpoint_manifest(start_from).metadata.get("training_state") and not c.checkpoint.finetune:
            resume = start_from  # a full RL checkpoint as --load resumes, as without LoRA
            partial = {"load_optim": not c.checkpoint.no_load_optim, "load_rng": not c.checkpoint.no_load_rng}
        self.lora_kl = bool(c.algorithm.use_kl_loss or c.algorithm.kl_coef)
        if resume is None:
            self.lora_reference = lora_weights.start_weights(self.bridge, self.models, c)
            self.optimizer.reload_model_params()
            return 0
        lora_weights.load_base(self.bridge, self.models, lora_weights.recorded_base(resume))
        if self.lora_kl:
            self.lora_reference = lora_weights.reference_snapshot(self.models, c)
        state = load_checkpoint(self.models, resume, self.optimizer, self.scheduler, **partial)
        self.loaded_extra_state = state.extra_state
        logger.info("rank %d: resumed LoRA adapters from %s, next rollout %d", self.rank, resume, state.iteration + 1)
        return state.iteration + 1

    def _load_weights(self) -> int:
        from slime.backends.megatron.checkpoint import (
            latest_checkpoint,
            load_checkpoint,
            load_model_checkpoint,
            read_checkpoint_manifest,
            reference_checkpoint,
            resolve_checkpoint,
        )
        from slime.backends.megatron.megatron_lm import is_megatron_lm_checkpoint

        ck = self.config.checkpoint
        resume = latest_checkpoint(ck.save) if ck.save else None
        partial = {}  # Megatron's --no-load-optim / --no-load-rng: for the start from `load`, never an own resume
        if resume is None and ck.load:
            path = resolve_checkpoint(ck.load)
            # a Megatron-LM / slime checkpoint continues its training, as its own --load would (megatron_lm.py)
            meta = {"stage": STAGE, "training_state": True} if is_megatron_lm_checkpoint(path) else \
                read_checkpoint_manifest(path).metadata
            if meta.get("stage") == STAGE and meta.get("training_state") and not ck.finetune:
                resume = path
                partial = {"load_optim": not ck.no_load_optim, "load_rng": not ck.no_load_rng}
            else:
                load_model_checkpoint(self.models, path)
                # bf16/fp16: the optimizer's fp32 main copies were taken from the weights at build time; without
                # this the first step would write those (Megatron's random init) back over the loaded model
                self.optimizer.reload_model_params()
                logger.info("rank %d: weights from %s (model only%s)", self.rank, path,
                            ", --finetune" if ck.finetune else "")
                return 0
        if resume is not None:
            stage = STAGE if is_megatron_lm_checkpoint(resume) else read_checkpoint_manifest(resume).metadata.get("stage")
            if stage != STAGE:
                raise ConfigError(f"{resume} is a checkpoint of stage {stage!r}, not an RL checkpoint: give RL its "
                                  "own --save directory and pass the other checkpoint as --load or --ref-load")
            state = load_checkpoint(self.models, resume, self.optimizer, self.scheduler, **partial)
            self.loaded_extra_state = state.extra_state
            self.resumed_from, self.resume_partial = resume, partial  # the PPO critic resumes beside it
            logger.info("rank %d: resumed from %s, next rollout %d", self.rank, resume, state.iteration + 1)
            return state.iteration + 1
        if ck.ref_load:
            load_model_checkpoint(self.models, reference_checkpoint(ck))
        else:
            self.bridge.load_weights(self.models, ck.hf_checkpoint)
        self.optimizer.reload_model_params()  # the main params from the loaded weights, as above
        return 0

    def _load_reference(self) -> None:
        """The KL reference: `ref_load`; else the policy RL starts from (`load`, e.g. the pipeline's SFT
        checkpoint, also on a resume); else `hf_checkpoint`. (The GPU pipeline's first run took the untrained
        HF weights as reference while RL started from SFT: KL to the reference read 6.0 at step 0.)"""
        from slime.backends.megatron.checkpoint import (
            load_model_checkpoint,
            reference_checkpoint,
            resolve_checkpoint,
        )

        ck = self.config.checkpoint
        if ck.ref_load:
            load_model_checkpoint(self.ref_models, reference_checkpoint(ck))
        elif ck.load:
            load_model_checkpoint(self.ref_models, resolve_checkpoint(ck.load))
        else:
            self.bridge.load_weights(self.ref_models, ck.hf_checkpoint)
        for model in self.ref_models:
            model.eval()

    def _load_teacher(self) -> None:
        """The on-policy distillation teacher: `opd_teacher_load` (its iteration `opd_teacher_ckpt_step` when set),
        loaded into a model of the student's architecture, as slime loads it into the student's Megatron model.
        A checkpoint of another architecture or vocabulary is refused: OPD compares the two models' log-probs
        of the same token ids."""
        from slime.backends.megatron.checkpoint import (
            CheckpointMismatchError,
            load_model_checkpoint,
            read_checkpoint_manifest,
            teacher_checkpoint,
        )

        path = teacher_checkpoint(self.config.checkpoint)
        hf = read_checkpoint_manifest(path).metadata.get("hf_config") or {}
        student_vocab = self.bridge.hf_config.vocab_size
        if hf.get("vocab_size") not in (None, student_vocab):
            raise ConfigError(f"checkpoint.opd_teacher_load {path}: the teacher's vocabulary has {hf['vocab_size']} "
                              f"tokens, the student's {student_vocab}: a Megatron OPD teacher must share the "
                              "student's tokenizer and architecture")
        try:
            load_model_checkpoint(self.teacher_models, path)
        except CheckpointMismatchError as exc:
            raise ConfigError(f"checkpoint.opd_teacher_load: a Megatron OPD teacher is loaded into a model of the "
                              f"student's architecture (as slime does), and this one differs: {exc}") from exc
        for model in self.teacher_models:  # scored under no_grad, never stepped: frozen, as offload parks it
            model.eval()
            model.requires_grad_(False)
        logger.info("rank %d: OPD teacher from %s", self.rank, path)

    def extra_state(self) -> dict[str, Any]:
        """The `extra_state` of the checkpoint `init` resumed from ({} when it did not resume)."""
        return self.loaded_extra_state

    def save(self, rollout_id: int, extra_state: dict[str, Any] | None = None, wait: bool = True) -> str:
        """Checkpoint iteration `rollout_id` under `save` (collective); its path (with node staging: its URL in
        the store, where every node uploaded its files). With --async-save the state is copied to host memory
        and written in the background: committed by a later `train` once every rank is done, or before this
        returns when `wait` (the run's last save, --release-train). With the PPO critic, its checkpoint is saved
        first, under `{save}/critic` (train_critic.py)."""
        from slime.backends.megatron.bridge import checkpoint_metadata
        from slime.backends.megatron.checkpoint import iteration_dir, save_checkpoint

        ck = self.config.checkpoint
        self.config.require("checkpoint.save", stage=STAGE)
        full = not ck.no_save_optim
        remote = self.node_staging.outputs.get(ck.save) if self.node_staging is not None else None
        if ck.async_save and self.saver is None:
            from slime.backends.megatron.async_save import AsyncSaver

            self.saver = AsyncSaver()
        metadata = {**checkpoint_metadata(self.bridge, ck.hf_checkpoint), "stage": STAGE}
        if self.critic_models is not None:  # first: a committed actor checkpoint always has its critic
            self._save_critic(rollout_id, full, remote, metadata)
        save_checkpoint(self.models, ck.save, rollout_id, optimizer=self.optimizer if full else None,
                        scheduler=self.scheduler if full else None, extra_state=extra_state or {},
                        metadata=metadata,
                        config_hash=self.config.section_hash("train", "algorithm", "checkpoint", "megatron"),
                        fully_reshardable=ck.dist_ckpt_optim_fully_reshardable, remote=remote,
                        storage_options=self.config.run.storage_options, keep=ck.keep_checkpoints,
                        saver=self.saver)
        if self.saver is not None and wait:
            self.saver.wait()
        path = iteration_dir(ck.save, rollout_id)
        return self.node_staging.to_remote(path) if remote else path
