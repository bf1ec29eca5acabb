"""The trainer: advantage estimator and loss (`algorithm:`), optimisation and batching (`train:`), supervised
fine-tuning (`sft:`), and the checks that concern them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from slime.config.base import ConfigTree, Fail, _Section

AdvantageEstimator = Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]


class AlgorithmConfig(_Section):
    """Advantage estimator and loss (slime's names and defaults)."""

    advantage_estimator: AdvantageEstimator = "grpo"
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = "policy_loss"
    custom_loss_function_path: str | None = None
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float | None = Field(None, gt=0, description="None: same as eps_clip")
    eps_clip_c: float | None = Field(None, description="dual-clip constant; must be > 1")
    value_clip: float = Field(0.2, gt=0)
    num_critic_only_steps: int = Field(0, ge=0, description="PPO: the first N rollouts train only the critic, the "
                                                            "actor is not updated (slime's --num-critic-only-steps; "
                                                            ">= num_rollout: a critic-only run)")
    kl_coef: float = Field(0.0, ge=0, description="KL as a reward penalty (exclusive with use_kl_loss)")
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    entropy_coef: float = 0.0
    gamma: float = Field(1.0, ge=0, le=1)
    lambd: float = Field(1.0, ge=0, le=1)
    normalize_advantages: bool = Field(False, description="whiten advantages over the data-parallel batch")
    disable_rewards_normalization: bool = False
    disable_grpo_std_normalization: bool = False
    use_rollout_logprobs: bool = False
    use_tis: bool = False
    tis_clip: float = Field(2.0, gt=0)
    tis_clip_low: float = Field(0.0, ge=0)
    calculate_per_token_loss: bool = Field(False, description="loss averaged over all tokens of the step, not "
                                                               "per sample then over samples")
    custom_tis_function_path: str | None = Field(
        None, description="with use_tis: slime's TIS function fn(args=, pg_loss=, train_log_probs=, rollout_log_probs="
                          ", loss_masks=, total_lengths=, response_lengths=) -> (pg_loss, loss_masks, metrics)")
    custom_pg_loss_reducer_function_path: str | None = Field(
        None, description="fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer "
                          "for pg_loss only (slime's); other terms keep the default reduction")
    use_rollout_entropy: bool = Field(False, description="also compute the actor's per-token entropy in the "
                                                         "log-prob pass: rollout/entropy, rollout_data['entropy'] for "
                                                         "the data hooks")
    get_mismatch_metrics: bool = Field(False, description="log train/mismatch/{tis,tis_clipfrac,tis_abs,ois}: the "
                                                          "trainer/engine importance ratios (no reweighting here)")
    use_unbiased_kl: bool = Field(False, description="KL loss weighted by the importance ratio pi / pi_old")
    use_opsm: bool = Field(False, description="off-policy sequence masking: no policy loss for a sequence with a "
                                              "negative advantage whose mean old - new log-prob exceeds opsm_delta")
    opsm_delta: float = Field(1e-4, ge=0, description="OPSM's sequence-KL threshold")
    keep_old_actor: bool = Field(False, description="old log-probs under a host copy of the weights the engines "
                                                    "generated with (not the current actor): the previous sync's "
                                                    "with update_weights_interval 1 (one-step-off), else the last")
    ref_update_interval: int | None = Field(None, ge=1, description="copy the actor's weights into the KL reference "
                                                                    "every N rollouts (after training rollout N-1)")
    disable_compute_advantages_and_returns: bool = Field(
        False, description="no reference/old log-prob passes and no advantage estimator: advantages come with the "
                           "samples (metadata['advantage']), the ratio's denominator is the step's own log-probs")
    use_opd: bool = Field(False, description="on-policy distillation: advantages -= opd_kl_coef * (student - "
                                             "teacher log-prob) per response token (docs/rl.md)")
    opd_type: Literal["megatron", "sglang"] | None = Field(
        None, description="where the teacher's log-probs come from: megatron (a frozen teacher model in the train "
                          "ranks, checkpoint.opd_teacher_load); sglang is refused here (docs/rl.md)")
    opd_kl_coef: float = Field(1.0, description="weight of the OPD reverse-KL penalty on the advantages")
    use_routing_replay: bool = Field(False, description="MoE (slime's R2, arXiv 2507.18071): the old-log-prob pass "
                                                        "records the experts each token is routed to, the rollout's "
                                                        "train steps replay them (slime/backends/megatron/"
                                                        "routing_replay.py)")
    use_rollout_routing_replay: bool = Field(
        False, description="MoE (R3, arXiv 2510.11370): the rollout asks the engines for the experts each token was "
                           "routed to (Sample.rollout_routed_experts), and the old-log-prob pass and train steps "
                           "route every token to them; the gating weights stay the trainer's router's")


class TrainConfig(_Section):
    """Optimisation and batching of the trainer."""

    global_batch_size: int | None = Field(None, ge=1, description="samples per optimizer step")
    num_steps_per_rollout: int | None = Field(None, ge=1, description="alternative to global_batch_size")
    micro_batch_size: int = Field(1, ge=1, description="samples per forward/backward pass (without "
                                                            "use_dynamic_batch_size)")
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    lr: float = Field(1e-6, gt=0, description="peak learning rate (after warmup)")
    clip_grad: float = Field(1.0, ge=0, description="gradient-norm clipping; 0: off")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="adam is AdamW (decoupled weight decay); sgd "
                                                                  "has no momentum")
    weight_decay: float = Field(0.0, ge=0, description="Megatron's default is 0.01, slime's scripts use 0.1")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay")
    adam_beta2: float = Field(0.98, ge=0, lt=1, description="AdamW second-moment decay")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW denominator epsilon")
    fused_adam: bool | None = Field(None, description="torch's fused AdamW kernel in place of the foreach one "
                                                      "megatron builds without Apex/TE; None: on under CUDA "
                                                      "(slime/backends/megatron/optimizer.py)")
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = Field(
        "constant", description="megatron-core OptimizerParamScheduler; stepped once per optimizer step")
    lr_warmup_iters: int = Field(0, ge=0, description="linear warmup from lr_warmup_init to lr, in optimizer steps")
    lr_decay_iters: int | None = Field(None, ge=1, description="steps from 0 to min_lr; None: the stage's total "
                                                               "optimizer steps")
    lr_wsd_decay_iters: int | None = Field(None, ge=1, description="WSD: length of the final decay phase")
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = Field(
        "exponential", description="WSD: shape of the final decay phase")
    min_lr: float = Field(0.0, ge=0, description="learning rate at the end of the decay")
    lr_warmup_init: float = Field(0.0, ge=0, description="learning rate of the first warmup step")
    use_distributed_optimizer: bool = Field(False, description="shard optimizer state over data-parallel ranks "
                                                               "(megatron DistributedOptimizer)")
    train_env_vars: dict[str, str] = Field(default_factory=dict, description="environment variables of the train "
                                                                             "rank processes (Ray runtime_env)")
    log_probs_max_tokens_per_gpu: int | None = Field(None, ge=1, description="dynamic batch size of the log-prob "
                                                     "passes (no backward: may be larger); None: max_tokens_per_gpu")
    only_train_params_name_list: list[str] | None = Field(None, description="regexes of the Megatron parameter "
                                                          "names to train; every other parameter is frozen")
    freeze_params_name_list: list[str] | None = Field(None, description="regexes of the Megatron parameter names "
                                                      "to freeze (slime/backends/megatron/freeze.py)")
    reset_optimizer_states: bool = Field(False, description="zero Adam's step and moments after each rollout's "
                                                            "training")
    use_stateless_adam: bool = Field(False, description="Adam whose moments start from zero at every optimizer step "
                                                        "(slime's StatelessAdam update); needs no_save_optim")
    data_pad_size_multiplier: int = Field(1, ge=1, description="right-pad every micro-batch's sequence length to a "
                                                               "multiple of this")
    log_probs_chunk_size: int = Field(-1, description="score response positions in chunks of this many (log-softmax "
                                                      "over the vocabulary per chunk, less peak memory); -1: the "
                                                      "scorer's default (chunks of ~2^26 fp32 values, or all at "
                                                      "once under tensor parallelism); the values do not change")
    compile_scores: bool | None = Field(None, description="torch.compile the log-softmax over the vocabulary that "
                                                          "scores response tokens (forward and backward, chunk by "
                                                          "chunk: fused kernels, no fp32 copy of the logits); "
                                                          "unset: on under CUDA with Triton; false: eager kernels")
    fp32_logits: bool = Field(False, description="upcast the [B, S, V] logits to fp32 before scoring them "
                                                 "(megatron's Float16Module does by default); false: the scoring "
                                                 "reads the bf16 logits, upcasting chunk by chunk (the same "
                                                 "values, without an fp32 copy of the logits and its gradient)")
    megatron_config_path: str | None = Field(None, description="slime's per-role Megatron YAML (megatron: [{name, "
                                                               "role: actor, overrides: {...}}]): the actor entry's "
                                                               "overrides win over flags and YAML; critic: ignored")
    recompute_loss_function: bool = Field(False, description="score the logits and compute the loss under "
                                                             "torch.utils.checkpoint: recomputed in the backward "
                                                             "pass instead of keeping the softmax activations")
    balance_by_flops: bool = Field(False, description="dynamic batching: ceil(tokens / max_tokens_per_gpu) "
                                                      "micro-batches of even estimated FLOPs (Karmarkar-Karp) "
                                                      "instead of first-fit; may pass the token limit, as in slime")
    balance_data: bool = Field(False, description="split each step's samples over data-parallel ranks by "
                                                  "Karmarkar-Karp on estimated forward FLOPs (equal counts)")
    custom_advantage_function_path: str | None = Field(
        None, description="fn(args, rollout_data) sets advantages and returns, instead of the estimator "
                          "(slime/backends/megatron/hooks.py)")
    rollout_data_postprocess_path: str | None = Field(
        None, description="fn(args, rollout_id, rollout_data) after the advantages; may change advantages and "
                          "loss_masks")
    custom_megatron_init_path: str | None = Field(None, description="init(args), after Megatron's process groups "
                                                                    "(slime/backends/megatron/hooks.py)")
    custom_megatron_before_log_prob_hook_path: str | None = Field(
        None, description="hook(args, model, store_prefix) before each log-prob pass ('' actor, 'ref_' reference)")
    custom_megatron_before_train_step_hook_path: str | None = Field(
        None, description="hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) before each step")


class SftConfig(_Section):
    """Supervised fine-tuning (cold start) data and epochs."""

    sft_data: str | None = Field(None, description="chat-messages JSONL/Parquet or an SFT shard set URI")
    messages_key: str = Field("messages", description="key of the chat messages in each SFT row")
    loss_mask_type: Literal["qwen", "qwen3", "qwen3_5", "distill_qwen"] | None = Field(
        None, description="slime's per-message loss masks for chat templates without {% generation %} blocks "
                          "(slime/data/loss_mask.py); None: the template's generation marks")
    sft_num_epoch: int = Field(1, ge=1, description="passes over sft_data")
    sft_save_interval: int | None = Field(None, ge=1, description="save the full SFT training state every N "
                                          "optimizer steps (resume point); None: only at the end")
    # SFT usually wants a larger step size than RL from the same `train` section: these override it for SFT only
    sft_lr: float | None = Field(None, gt=0, description="SFT's peak learning rate; None: train.lr")
    sft_min_lr: float | None = Field(None, ge=0, description="SFT's final learning rate; None: train.min_lr")
    sft_lr_warmup_iters: int | None = Field(None, ge=0, description="SFT's warmup steps; None: "
                                            "train.lr_warmup_iters")
    sft_lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] | None = Field(
        None, description="SFT's learning-rate schedule; None: train.lr_decay_style")

    def train_overrides(self) -> dict[str, Any]:
        """The `train` fields SFT sets differently (only those given)."""
        given = {"lr": self.sft_lr, "min_lr": self.sft_min_lr, "lr_warmup_iters": self.sft_lr_warmup_iters,
                 "lr_decay_style": self.sft_lr_decay_style}
        return {k: v for k, v in given.items() if v is not None}


_SFT_SCHEDULE_FIELDS = {"lr": "sft.sft_lr", "min_lr": "sft.sft_min_lr", "lr_warmup_iters": "sft.sft_lr_warmup_iters",
                        "lr_decay_style": "sft.sft_lr_decay_style"}


def check_loss_type(config: ConfigTree, fail: Fail) -> None:
    """The loss types the Megatron train step runs."""
    a = config.algorithm
    if a.loss_type == "custom_loss":  # refused here, not at the first train step after the engines started
        fail("algorithm.loss_type", "custom_loss (slime's --custom-loss-function-path, called with Megatron's "
             "batch and logits) is not supported by the Megatron train step here; use policy_loss or sft_loss, "
             "and reshape the training signal with --custom-advantage-function-path or "
             "--rollout-data-postprocess-path (docs/megatron.md)", "algorithm.custom_loss_function_path")


def check_critic_only_steps(config: ConfigTree, fail: Fail) -> None:
    """slime's --num-critic-only-steps counts rollouts in which only the PPO critic trains; with another
    estimator there is no critic, and slime would silently train the actor anyway: refused here instead."""
    a = config.algorithm
    if a.num_critic_only_steps and a.advantage_estimator != "ppo":
        fail("algorithm.num_critic_only_steps", f"num_critic_only_steps {a.num_critic_only_steps} trains only the "
             f"PPO critic for the first rollouts, and advantage_estimator {a.advantage_estimator!r} has no critic: "
             "set --advantage-estimator ppo, or drop --num-critic-only-steps", "algorithm.advantage_estimator")


def check_ppo_critic(config: ConfigTree, fail: Fail) -> None:
    """The PPO critic is a full-parameter model built beside the actor (slime/ray/train_critic.py); the LoRA train
    path builds adapters on a frozen base and no critic, so ppo with LoRA would have no values: refused here."""
    if config.algorithm.advantage_estimator == "ppo" and config.lora.lora_rank:
        fail("algorithm.advantage_estimator", "ppo trains a value critic beside the actor, which the LoRA train path "
             "does not build: use a full-parameter actor (lora_rank 0) for ppo, or another estimator with LoRA",
             "lora.lora_rank")


def check_batch_shape(config: ConfigTree, fail: Fail) -> None:
    """A rollout splits into whole optimizer steps, and a step into micro-batches."""
    r, t = config.rollout, config.train
    if r.rollout_batch_size and t.global_batch_size:
        samples = r.rollout_batch_size * r.n_samples_per_prompt
        if samples % t.global_batch_size:
            fail(
                "train.global_batch_size",
                f"rollout_batch_size * n_samples_per_prompt = {r.rollout_batch_size} * "
                f"{r.n_samples_per_prompt} = {samples} must be a multiple of global_batch_size "
                f"({t.global_batch_size})",
                "rollout.rollout_batch_size",
                "rollout.n_samples_per_prompt",
            )
    if t.global_batch_size and t.num_steps_per_rollout:
        fail("train.num_steps_per_rollout", "set either global_batch_size or num_steps_per_rollout, not both")
    if t.global_batch_size and t.global_batch_size % t.micro_batch_size and not t.use_dynamic_batch_size:
        fail("train.micro_batch_size", f"global_batch_size {t.global_batch_size} is not a multiple of "
             f"micro_batch_size {t.micro_batch_size}")
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        fail("train.use_dynamic_batch_size", "use_dynamic_batch_size needs max_tokens_per_gpu")


def check_policy_terms(config: ConfigTree, fail: Fail) -> None:
    """The KL, clipping and importance-sampling settings fit together."""
    a = config.algorithm
    if a.kl_coef and (a.use_kl_loss or a.kl_loss_coef):
        fail("algorithm.kl_coef", "kl_coef (reward penalty) and use_kl_loss/kl_loss_coef (loss term) are exclusive",
             "algorithm.use_kl_loss", "algorithm.kl_loss_coef")
    if a.kl_loss_coef and not a.use_kl_loss:
        fail("algorithm.kl_loss_coef", "kl_loss_coef is set but use_kl_loss is false")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        fail("algorithm.eps_clip_c", f"dual-clip constant must be > 1, got {a.eps_clip_c}")
    if a.custom_tis_function_path and not a.use_tis:
        fail("algorithm.custom_tis_function_path", "is applied with use_tis: set --use-tis too")
    if a.use_tis and a.tis_clip_low >= a.tis_clip:
        fail("algorithm.tis_clip_low", f"tis_clip_low {a.tis_clip_low} must be below tis_clip {a.tis_clip}")
    if a.advantage_estimator.startswith("reinforce_plus_plus") and not a.normalize_advantages:
        fail("algorithm.advantage_estimator", f"{a.advantage_estimator} needs normalize_advantages: true")


def check_lr_schedules(config: ConfigTree, fail: Fail) -> None:
    """The learning-rate schedule of RL, and of SFT with its overrides."""
    # the RL schedule, then SFT's own where sft_* fields override it (named by the field that was set)
    for t, name in ((config.train, {}), (config.sft_train(), _SFT_SCHEDULE_FIELDS)):
        def field(n: str, name: dict[str, str] = name) -> str:
            return name.get(n, f"train.{n}")

        if t.min_lr > t.lr:
            fail(field("min_lr"), f"min_lr {t.min_lr} is above lr {t.lr}", field("lr"))
        if t.lr_warmup_init > t.lr:
            fail("train.lr_warmup_init", f"lr_warmup_init {t.lr_warmup_init} is above lr {t.lr}", field("lr"))
        if t.lr_decay_iters is not None and t.lr_warmup_iters >= t.lr_decay_iters:
            fail(field("lr_warmup_iters"), f"lr_warmup_iters {t.lr_warmup_iters} must be below lr_decay_iters "
                 f"{t.lr_decay_iters}", "train.lr_decay_iters")
        if t.lr_decay_style == "WSD" and t.lr_wsd_decay_iters is None:
            fail(field("lr_decay_style"), "WSD needs lr_wsd_decay_iters (length of the decay phase)")


def check_flops_balance(config: ConfigTree, fail: Fail) -> None:
    """balance_by_flops balances dynamic batching's micro-batches."""
    t = config.train
    if t.balance_by_flops and not t.use_dynamic_batch_size:
        fail("train.balance_by_flops", "balances the micro-batches of dynamic batching: set use_dynamic_batch_size "
             "and max_tokens_per_gpu")


def check_stateless_adam(config: ConfigTree, fail: Fail) -> None:
    """Stateless Adam is Adam, and keeps no optimizer state to save."""
    t = config.train
    if t.use_stateless_adam and t.optimizer != "adam":
        fail("train.use_stateless_adam", f"stateless Adam needs optimizer adam, not {t.optimizer}", "train.optimizer")
    if t.use_stateless_adam and not config.checkpoint.no_save_optim:
        fail("train.use_stateless_adam", "stateless Adam keeps no moments to save: set no_save_optim "
             "(--no-save-optim), as slime requires")


def check_ref_update_interval(config: ConfigTree, fail: Fail) -> None:
    """ref_update_interval needs a reference model."""
    a = config.algorithm
    if a.ref_update_interval and not (a.use_kl_loss or a.kl_coef):
        fail("algorithm.ref_update_interval", "there is no reference model to update: it is built for use_kl_loss "
             "or kl_coef")


def check_opd(config: ConfigTree, fail: Fail) -> None:
    """On-policy distillation, as slime validates it (opd_type required; a Megatron teacher needs
    opd_teacher_load, which means nothing without use_opd), plus what is not built here."""
    a, ck = config.algorithm, config.checkpoint
    if not a.use_opd:
        if ck.opd_teacher_load is not None:
            fail("checkpoint.opd_teacher_load", "is set but use_opd is not: add --use-opd (and --opd-type megatron)",
                 "algorithm.use_opd")
        return
    if a.opd_type is None:
        fail("algorithm.opd_type", "--use-opd needs --opd-type: megatron (a teacher checkpoint in the train ranks, "
             "--opd-teacher-load)", "algorithm.use_opd")
    if a.opd_type == "sglang":
        fail("algorithm.opd_type", "sglang is not built here (slime's teacher engine behind --rm-url returns a dict "
             "reward and its --custom-reward-post-process-path hook copies the teacher's log-probs into "
             "sample.teacher_log_probs; the train ranks here take a teacher's log-probs only from a Megatron "
             "teacher, and the rollout's reward metrics need a scalar reward); use --opd-type megatron with the "
             "teacher's Megatron checkpoint as --opd-teacher-load", "algorithm.use_opd")
    if ck.opd_teacher_load is None:
        fail("checkpoint.opd_teacher_load", "--opd-type megatron needs the teacher's Megatron checkpoint "
             "(--opd-teacher-load)", "algorithm.opd_type")
    if config.lora.enabled:
        fail("algorithm.use_opd", "a Megatron OPD teacher next to LoRA adapters is not built here: train without "
             "LoRA, or merge the adapters first", "lora.lora_rank")


def check_given_advantages(config: ConfigTree, fail: Fail) -> None:
    """Advantages that come with the samples leave nothing that needs the passes this turns off."""
    a, t = config.algorithm, config.train
    if a.disable_compute_advantages_and_returns:
        given = [n for n in ("use_kl_loss", "kl_coef", "custom_advantage_function_path", "normalize_advantages",
                             "keep_old_actor", "use_opd")
                 if getattr(a if n != "custom_advantage_function_path" else t, n)]
        if given:
            fail("algorithm.disable_compute_advantages_and_returns", f"{given[0]} needs the reference/old log-prob "
                 "passes or the advantage computation that this flag turns off")


def check_routing_replay(config: ConfigTree, fail: Fail) -> None:
    """R3 needs engines that return the routed experts: the built-in engine does for a MoE model, SGLang servers
    when launched with --enable-return-routed-experts, which the launcher adds (slime/engines/launch.py) unless the
    config turns it off. (A dense model is refused when the trainer builds it: the HF config tells.)"""
    a = config.algorithm
    if a.use_rollout_routing_replay and config.engine.engine == "sglang" \
            and config.sglang_arg("enable_return_routed_experts") is False:
        fail("algorithm.use_rollout_routing_replay", "replays the experts the SGLang engines return, and "
             "sglang.enable_return_routed_experts is false: drop it (the launcher turns it on)",
             "sglang.enable_return_routed_experts")


def check_loss_mask_type(config: ConfigTree, fail: Fail) -> None:
    """The SFT loss masks built here."""
    if config.sft.loss_mask_type == "qwen3_5":
        fail("sft.loss_mask_type", "qwen3_5 (offset mapping over the rendered text) is not built here: use qwen, "
             "qwen3 or distill_qwen, or a template with {% generation %} blocks")
