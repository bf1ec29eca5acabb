"""GLM-4.5 (HF glm4_moe) through mbridge and megatron-core on CPU (fp32), on the tiny random GLM-4.5 of
slime/data/random_models.py (a dense first layer, 8 routed experts top-2 in 2 groups of which 1 is picked, a shared
expert, sigmoid scores with a random expert bias, routed_scaling_factor 2.5, half-rotary heads, q/k norms, qkv
biases). The HF -> Megatron -> HF round trip is test_convert_export.py's ("glm4-moe": bit-exact, logits 1.9e-7).

Tolerances and measured values (2-core CPU):
* log-probs against HF 1e-5, entropy 1e-4 (as the dense models' and Qwen3-MoE's): measured 4.8e-7 / 1.4e-6. Each
  GLM-4.5 trait taken out moves the log-probs by far more (measured: no expert groups 5.1e-2, no scaling factor
  4.2e-2, no expert bias 8.3e-2, every dimension rotated 1.7e-1), so a bug in any of them would show; the bias
  only selects (HF weighs by the unbiased scores), which no ablation here needs to isolate: weighting by the biased
  scores would break the 1e-5 parity.
* EP 2 vs EP 1 (slow): as test_moe.py's, loss 1e-6 abs, grad norm 1e-5 rel, log-probs 1e-5, exported weights 1e-6,
  here with the expert-bias update on (rate 0.01), whose token counts are all-reduced over the data-parallel ranks
  (measured: loss equal, grad norm 8.9e-8 relative, log-probs 9.5e-7, weights 1.2e-7, the bias equal).
* R3 (slow): the rollout (transformers, glm4_moe_replay.py) with its router weights perturbed by 30 % (10 % flips
  only 1.4 % of the (token, layer) routings of this model; 30 %: 37 of 440, 8.4 %). Replaying its experts cuts the
  mean and max train/rollout log-prob gap and the first step's |ppo_kl| to under 0.2 of what they are without (the
  Qwen3-MoE test's bound); measured mean 2.8e-3 -> 2.3e-4, max 4.8e-2 -> 1.3e-3, |ppo_kl| 6.9e-4 -> 1.1e-5.
"""

import json
from pathlib import Path

import pytest
from multirank import run_ranks
from safetensors.torch import load_file
from script_rows import rows_by_case, run_script, run_scripts
from test_checkpoint_resume import assert_bit_exact, run_and_resume

from slime.data.random_models import glm4_moe_config, save_random_glm4_moe
from slime.errors import ConfigError

EP_SCRIPT = Path(__file__).with_name("moe_ep_parity.py")


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> Path:
    return save_random_glm4_moe(tmp_path_factory.mktemp("glm4-moe") / "tiny", "tiny")


@pytest.fixture(scope="module")
def rows(glm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4-moe-mtp")
    mtp_dir = save_random_glm4_moe(root / "tiny-mtp", "tiny", num_nextn_predict_layers=1)
    runs = run_scripts({"a": ("glm4_moe_run.py", glm_dir, "parity", "options", "lora"),
                        "b": ("glm4_moe_run.py", glm_dir, "steps", f"mtp={mtp_dir},{root / 'work'}")}, timeout=400)
    return {**rows_by_case(runs["a"].result() + runs["b"].result()), "mtp_dir": mtp_dir}


def test_log_probs_match_hf_and_each_glm_trait_matters(rows):
    row = rows["parity"]
    assert row["max_gap"] < 1e-5 and row["entropy_gap"] < 1e-4, row
    assert row["dense_layers"] == [0] and row["shared_experts"] == [False, True, True]
    assert min(row["ablations"].values()) > 1e-2, row["ablations"]  # > 1000x the tolerance


def test_slimes_glm45_flags_are_accepted_and_contradictions_refused(rows):
    row = rows["options"]
    assert row["moe_layer_freq"] == [0, 1, 1] and row["ffn_hidden_size"] == 128  # the dense layer's MLP
    assert row["moe_shared_expert_intermediate_size"] == 32 and row["moe_ffn_hidden_size"] == 32
    assert (row["moe_router_score_function"], row["moe_router_enable_expert_bias"]) == ("sigmoid", True)
    assert row["moe_router_topk_scaling_factor"] == 2.5
    assert (row["moe_router_num_groups"], row["moe_router_group_topk"]) == (2, 1)
    assert row["qk_layernorm"] and row["add_qkv_bias"] and row["moe_router_dtype"] == "fp32"
    assert not row["moe_grouped_gemm"] and not row["moe_shared_expert_overlap"]
    # the bias is kept during RL unless a rate is given (slime's scripts pass 0)
    assert row["moe_router_bias_update_rate"] == 0 and row["given_rate"] == 0.001
    # slime's --moe-router-load-balancing-type seq_aux_loss with coefficient 0; a coefficient alone selects it too
    assert row["moe_aux_loss_coeff"] == 0 and row["aux_type"] == "seq_aux_loss"
    refused = row["refused"]
    assert all(refused.values()), refused
    assert "--rotary-percent 1.0, but the checkpoint gives 0.5" in refused["--rotary-percent"]
    assert "moe_layer_freq='[1]*3', but the checkpoint" in refused["--moe-layer-freq"]
    assert "gives [0, 1, 1]" in refused["--moe-layer-freq"]
    assert "gives 2.5" in refused["--moe-router-topk-scaling-factor"]
    assert "gives 'sigmoid'" in refused["--moe-router-score-function"]


def test_sft_and_grpo_steps_and_the_expert_bias_policy(rows):
    row = rows["steps"]
    losses = row["sft_losses"]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)) and losses[-1] < 0.8 * losses[0], losses
    for name in ("default", "rate"):
        part = row[name]
        assert all(m["grad_norm"] > 0.1 and m["update_successful"] == 1.0 for m in part["metrics"]), part
        assert abs(part["metrics"][0]["ppo_kl"]) < 1e-6  # old log-probs of the same weights
        # the dense layer, the routers, routed and shared experts, qkv biases and q norms all train
        assert min(part["moved"].values()) > 1e-4, part["moved"]
        assert part["exported_bias_equal"], part  # e_score_correction_bias is the router's expert_bias
    assert row["default"]["rate"] == 0 and row["default"]["bias_changed"] == 0.0
    # megatron's aux-loss-free balancing: every bias moves by exactly the rate each step (sign of its load offset)
    assert row["rate"]["bias_moves"] == [[0.01], [0.01]]
    assert row["rate"]["bias_changed"] == pytest.approx(0.02, abs=1e-6)


def test_mtp_layers_are_skipped_at_load_and_carried_by_export(rows):
    from transformers import AutoModelForCausalLM

    row, source_dir = rows["mtp"], rows["mtp_dir"]
    assert len(row["logs"]) == 1 and "1 MTP layer(s) (HF layers [3], 44 tensors) not loaded" in row["logs"][0]
    source, exported = load_file(source_dir / "model.safetensors"), load_file(Path(row["export"]) / "model.safetensors")
    assert sorted(source) == sorted(exported)
    assert all(source[k].equal(exported[k]) for k in source)  # bit-exact, the MTP layer carried unchanged
    assert row["carried"] == sorted(k for k in source if k.startswith("model.layers.3."))
    manifest = json.loads((Path(row["export"]) / "manifest.json").read_text())
    assert manifest["metadata"]["carried_from_origin"] == row["carried"]
    model = AutoModelForCausalLM.from_pretrained(row["export"])
    assert model.config.num_nextn_predict_layers == 1 and len(model.model.layers) == 3


@pytest.mark.parametrize(("overrides", "message"), [
    ({"norm_topk_prob": False}, "norm_topk_prob false is not supported for glm4_moe"),
    ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 4}, "HF scores a group by its two best experts"),
    ({"n_group": 3}, "n_group 3 does not divide n_routed_experts 8"),
])
def test_routers_megatron_cannot_compute_are_refused(tmp_path, overrides, message):
    from slime.backends.megatron.bridge import load_hf_config

    glm4_moe_config("tiny", **overrides).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=message):
        load_hf_config(str(tmp_path))


def test_lora_on_glm4_moe_is_refused(rows):
    message = rows["lora"]["refused"]
    assert message and message.startswith("LoRA on a mixture-of-experts model is not supported yet"), message


@pytest.mark.slow  # two rank processes, 28 s (passed 2026-11-28): loss equal, grad norm 8.9e-8 rel, log-probs 9.5e-7
def test_expert_parallel_equals_all_experts_on_each_rank(glm_dir, tmp_path):
    megatron = {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001, "moe_router_bias_update_rate": 0.01}
    ranks = run_ranks(EP_SCRIPT, 2, [str(glm_dir), str(tmp_path), json.dumps(megatron)], timeout=400)
    one, two = ([rows[i] for rows in ranks] for i in (0, 1))
    assert [r["local_experts"] for r in one + two] == [8, 8, 4, 4]
    for a, b in zip(one, two, strict=True):
        for step_a, step_b in zip(a["metrics"], b["metrics"], strict=True):
            assert step_b["loss"] == pytest.approx(step_a["loss"], abs=1e-6)
            assert step_b["grad_norm"] == pytest.approx(step_a["grad_norm"], rel=1e-5)
        gap = max(abs(x - y) for la, lb in zip(a["log_probs"], b["log_probs"], strict=True)
                  for x, y in zip(la, lb, strict=True))
        assert gap < 1e-5, gap
    ep1, ep2 = load_file(tmp_path / "ep1.safetensors"), load_file(tmp_path / "ep2.safetensors")
    source = load_file(glm_dir / "model.safetensors")
    assert ep1.keys() == ep2.keys() == source.keys()
    assert max((ep1[k] - ep2[k]).abs().max().item() for k in ep1) < 1e-6
    bias = [k for k in source if k.endswith("e_score_correction_bias")]
    assert all((ep1[k] - source[k]).abs().max().item() == pytest.approx(0.02, abs=1e-6) for k in bias)
    assert all(ep1[k].equal(ep2[k]) for k in bias)  # the same global token counts on both layouts


@pytest.mark.slow  # 44 s (passed 2026-11-28): two runs of one rank
def test_resume_is_bit_exact_with_the_expert_bias_moving(glm_dir, tmp_path):
    run, resume = run_and_resume(glm_dir, tmp_path, 1, "--megatron", json.dumps({"moe_router_bias_update_rate": 0.01}))
    assert_bit_exact(run, resume)  # weights, expert bias, optimizer, lr, RNG draws
    assert len({row["expert_bias"] for row in run[0]}) == len(run[0])  # the bias moved at every step


@pytest.mark.slow  # two rank processes, 50 s (passed 2026-11-28)
def test_resume_with_expert_parallel_is_bit_exact(glm_dir, tmp_path):
    run, resume = run_and_resume(glm_dir, tmp_path, 2, "--distributed", "dp_reshardable", "--expert-parallel", "2",
                                 "--megatron", json.dumps({"moe_router_bias_update_rate": 0.01}))
    assert_bit_exact(run, resume)


@pytest.mark.slow  # 7 s (passed 2026-11-28); the Qwen3-MoE replay tests cover the rest (errors, the train rank)
def test_routing_replay_uses_the_given_experts_on_the_moe_layers(glm_dir):
    rows = rows_by_case(run_script("routing_replay_run.py", glm_dir, "replayed", "r2", timeout=300))
    for part in rows["replayed"]["plain"], rows["replayed"]["recompute"]:
        assert part["natural_mismatches"] > part["tokens"] and part["log_prob_mismatches"] == 0, part
        assert part["train_mismatches"] == 0 and part["replay_changes_log_probs"] > 1e-3, part
    r2 = rows["r2"]
    assert r2["record_mismatches"] == 0 and r2["second_step_mismatches"] == 0, r2
    # [rows, num_layers, topk]: 3 layers, the dense layer 0 recorded as -1
    assert r2["record_shapes"][0] == [9, 3, 2] and r2["record_min"] == -1


@pytest.mark.slow  # 13 s (passed 2026-11-28)
def test_r3_narrows_the_gap_to_the_rollout(glm_dir):
    row = run_script("glm4_moe_replay.py", glm_dir, "0.3", timeout=400)[0]
    without, with_r3 = row["without_r3"], row["with_r3"]
    assert row["router_layers"] == [1, 2] and row["dense_layer_ids"] == [-1]
    assert row["routing_flips"] > 0.03 * row["routed_token_layers"], row
    assert with_r3["mean_abs_gap"] < 0.2 * without["mean_abs_gap"], row
    assert with_r3["max_abs_gap"] < 0.2 * without["max_abs_gap"], row
    assert abs(with_r3["ppo_kl"]) < 0.2 * abs(without["ppo_kl"]), row
