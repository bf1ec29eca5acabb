"""bench/train_step.py --loss grpo's pieces (reference model, old/reference log-prob recompute) on CPU."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def test_grpo_step_pieces(tiny_kit):
    result = subprocess.run([sys.executable, str(HERE / "train_step_grpo.py"), str(tiny_kit.model_dir)],
                            capture_output=True, text=True, timeout=300, cwd=HERE.parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][0])
    first, second = row["steps"]
    assert row["ref_trainable"] == 0  # frozen
    # the old log-probs are the policy's own; the reference starts as the policy, so the first KL is 0
    assert first["old_vs_direct"] < 1e-6 and first["old_vs_ref"] < 1e-6 and first["kl_loss"] < 1e-9, row
    # after one step the policy has moved away from the frozen reference
    assert second["old_vs_direct"] < 1e-6 and second["old_vs_ref"] > 1e-4 and second["kl_loss"] > 0, row
    assert first["grad_norm"] > 0, row
    # --reuse-log-probs: no old-policy pass, and the same step
    recomputed, reused = row["reuse"]["false"], row["reuse"]["true"]
    assert recomputed["has_old"] and not reused["has_old"], row
    for key in ("loss", "grad_norm", "pg_loss"):
        assert reused[key] == pytest.approx(recomputed[key], rel=1e-6, abs=1e-7), key
    assert row["packed_gap"] < 1e-5, row  # --log-probs-max-tokens: packed passes, the same log-probs
    # --against-reference: both arms stepped (3 steps each moved their weights) and were timed
    against = row["against"]
    assert against["moved"]["megatron"] > 0 and against["moved"]["reference"] > 0, against
    assert against["megatron_step_s"] > 0 and against["reference_step_s"] > 0, against
    assert against["reference_over_megatron"] == pytest.approx(
        against["reference_step_s"] / against["megatron_step_s"], rel=1e-2), against


def test_megatron_options_are_read_as_the_config_reads_them():
    sys.path.insert(0, str(HERE.parents[1] / "bench"))
    from train_step import megatron_options

    assert megatron_options(["recompute_granularity=selective", "recompute_num_layers=2",
                             "bias_activation_fusion=false", "recompute_modules=[core_attn, mlp]"]) == {
        "recompute_granularity": "selective", "recompute_num_layers": 2, "bias_activation_fusion": False,
        "recompute_modules": ["core_attn", "mlp"]}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        megatron_options(["recompute_granularity"])
    with pytest.raises(SystemExit, match="cuda_graph_imp: not a model option"):
        megatron_options(["cuda_graph_imp=local"])  # a typo must not time the default


def test_each_ab_switch_flips_its_change_and_restores_it():
    sys.path.insert(0, str(HERE.parents[1] / "bench"))
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.tensor_parallel import layers as mcore_layers
    from megatron.core.transformer import mlp as mcore_mlp
    from train_step import AB_SWITCHES

    from slime.backends.megatron import host_trims, optimizer, rope_fusion, swiglu_kernel
    from slime.backends.megatron.train import StepSettings

    base = StepSettings(loss_type="sft_loss")
    fields = {"fp32-logits": ("fp32_logits", True), "compile-scores": ("compile_scores", False),
              "log-probs-chunk-size": ("log_probs_chunk_size", 441)}
    for name, (field, off_value) in fields.items():
        state = {"settings": base}
        toggle = AB_SWITCHES[name](state)
        toggle(False)
        assert getattr(state["settings"], field) == off_value != getattr(base, field), name
        toggle(True)
        assert state["settings"] is base
    process = {"rope-cos-sin-cache": lambda: rope_utils.fused_apply_rotary_pos_emb,
               "foreach-param-copy": lambda: mcore_optimizer._multi_tensor_copy_this_to_that,
               "host-trims": lambda: mcore_layers.LinearWithGradAccumulationAndAsyncCommunication.backward,
               "triton-rope": lambda: rope_utils.fused_apply_rotary_pos_emb,
               "compiled-rope": lambda: rope_utils.fused_apply_rotary_pos_emb,
               "triton-swiglu": lambda: mcore_mlp.bias_swiglu_impl}
    rope_fusion.install()
    optimizer.use_foreach_param_copy(True)
    host_trims.install(True)
    swiglu_kernel.install(True)
    for name, current in process.items():
        toggle = AB_SWITCHES[name]({})
        toggle(True)  # the default, except compiled-rope's on arm (the compiled rotation)
        on = current()
        toggle(False)
        assert current() is not on, name
        toggle(True)
        assert current() is on, name
    rope_fusion.install()
    assert rope_utils.fused_apply_rotary_pos_emb is rope_fusion.fused_apply_rotary_pos_emb

    # swiglu-fusion flips the config every MLP reads at its forward (one config shared by the model's modules)
    config = types.SimpleNamespace(bias_activation_fusion=True)
    toggle = AB_SWITCHES["swiglu-fusion"]({"models": [torch.nn.Module()]})
    toggle(False)  # a model without a config: nothing to flip, no error
    model = torch.nn.Module()
    model.config = config
    toggle = AB_SWITCHES["swiglu-fusion"]({"models": [model]})
    toggle(False)
    assert config.bias_activation_fusion is False
    toggle(True)
    assert config.bias_activation_fusion is True
