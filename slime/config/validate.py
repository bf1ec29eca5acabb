"""The checks that span fields, run once by `load_config` after the sections parsed: each lives beside its
section; this runs them in one fixed order (the first that fails names the error) and gives them `fail`, which
names the field and where it, and each related field, was set."""

from __future__ import annotations

from typing import NoReturn

from slime.config.checkpoint import check_load_flags
from slime.config.lora import check_lora
from slime.config.passthrough import check_engine_args, check_megatron
from slime.config.rollout import (
    check_engine_dtype,
    check_external_engines,
    check_global_dataset,
    check_http_timeout,
    check_over_sampling,
    check_prompt_fits_context,
    check_prompt_tokenizer,
    check_rollout_transport,
)
from slime.config.run import (
    check_debug_modes,
    check_grad_norm_files,
    check_memory_recorder,
    check_release_train,
    check_rollout_subsample,
    check_share_gpu,
    check_store,
)
from slime.config.sync import (
    check_adapter_sync,
    check_async_gpus,
    check_async_mode,
    check_eval_fleet,
    check_weight_sync_options,
)
from slime.config.training import (
    check_batch_shape,
    check_critic_only_steps,
    check_flops_balance,
    check_given_advantages,
    check_loss_mask_type,
    check_loss_type,
    check_lr_schedules,
    check_opd,
    check_policy_terms,
    check_ppo_critic,
    check_ref_update_interval,
    check_routing_replay,
    check_stateless_adam,
)
from slime.config.tree import Config, check_custom_config
from slime.errors import ConfigError


def validate(config: Config, where: dict[str, str]) -> None:
    """Checks that span fields; each message names the fields and where they were set."""

    def fail(field: str, message: str, *related: str) -> NoReturn:
        """Raise naming `field` and where it (and each related field that was set) came from."""
        source = where.get(field, "config")
        others = [f"{r} set at {where[r]}" for r in related if r in where]
        also = f" [{'; '.join(others)}]" if others else ""
        raise ConfigError(f"{source}: {field}: {message}{also}")

    check_loss_type(config, fail)
    check_batch_shape(config, fail)
    check_over_sampling(config, fail)
    check_policy_terms(config, fail)
    check_critic_only_steps(config, fail)
    check_ppo_critic(config, fail)
    check_lr_schedules(config, fail)
    check_async_mode(config, fail)
    check_share_gpu(config, fail)
    check_async_gpus(config, fail)
    check_eval_fleet(config, fail)
    check_store(config, fail)
    check_prompt_fits_context(config, fail)
    # checkpoint.save_interval without checkpoint.save: a stage saves to {store}/{run_id}/<stage>/checkpoint
    # (slime.preflight.place_outputs), which fails there when the run has no id
    check_prompt_tokenizer(config, fail, where)
    check_engine_dtype(config, fail)
    check_engine_args(config, where)
    check_http_timeout(config, fail)
    check_debug_modes(config, fail)
    check_external_engines(config, fail)
    check_load_flags(config, fail)
    check_release_train(config, fail)
    check_flops_balance(config, fail)
    check_stateless_adam(config, fail)
    check_ref_update_interval(config, fail)
    check_opd(config, fail)
    check_given_advantages(config, fail)
    check_memory_recorder(config, fail)
    check_global_dataset(config, fail)
    check_loss_mask_type(config, fail)
    check_routing_replay(config, fail)
    check_rollout_subsample(config, fail)
    check_grad_norm_files(config, fail)
    check_weight_sync_options(config, fail)
    check_lora(config, fail)
    check_adapter_sync(config, fail)
    check_rollout_transport(config, fail)
    check_custom_config(config, fail)
    check_megatron(config, fail)
