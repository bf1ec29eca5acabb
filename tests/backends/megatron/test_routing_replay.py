"""MoE routing replay (slime/backends/megatron/routing_replay.py): R3 replays the rollout engine's experts, R2 the
old-log-prob pass's, through megatron-core's RouterReplay, on the tiny Qwen3-MoE (fp32, CPU).

The layout of the replayed ids is checked here in-process; the rest runs as scripts (routing_replay_run.py, one
Megatron process each; routing_replay_ep.py on two ranks), with a spy (forward hook) on megatron's routers: the
experts they route to are the replayed ones, in the log-prob pass and the train step (activation recomputation
included), R2's recorded ones in a later step, under expert parallelism too; R3 narrows the gap to the built-in
engine's log-probs when the engine routes differently (engine_gap.py); and what is refused.
"""

from pathlib import Path

import pytest
import torch
from multirank import run_ranks
from script_rows import rows_by_case, run_script
from transformers import Qwen2Config

from slime.backends.megatron.routing_replay import Routers, check_record, micro_batch_ids
from slime.config import load_config
from slime.data.random_models import save_random_qwen3_moe
from slime.errors import ConfigError, DataFormatError
from slime.rollout.routing import wants_routed_experts
from slime.types import Sample

EP_SCRIPT = Path(__file__).with_name("routing_replay_ep.py")


def test_ids_follow_megatrons_token_order_and_fill_the_rest_with_distinct_experts():
    # layers 0 and 2 of 3 have routers; 8 experts, top-2; two samples of 4 and 6 tokens padded to 8
    routers = Routers(replays=((0, None), (2, None)), num_layers=3, num_experts=8, topk=2, sequence_parallel=False)
    records = [torch.randint(0, 8, (3, 3, 2), dtype=torch.int32), torch.randint(0, 8, (5, 3, 2), dtype=torch.int32)]
    ids = micro_batch_ids(records, 8, routers, "cpu")
    assert sorted(ids) == [0, 2] and all(t.shape == (8 * 2, 2) and t.dtype == torch.int64 for t in ids.values())
    for layer in (0, 2):
        grid = ids[layer].view(8, 2, 2)  # a router's tokens are (position, row): megatron's [S, b] flattened
        for row, record in enumerate(records):
            assert torch.equal(grid[: len(record), row], record[:, layer].long())
            rest = grid[len(record):, row]  # the last token and the padding: k distinct ids of [0, E)
            assert (rest[:, 0] != rest[:, 1]).all() and rest.min() >= 0 and rest.max() < 8


def test_records_are_checked_against_the_model():
    routers = Routers(replays=((0, None), (1, None)), num_layers=2, num_experts=8, topk=2, sequence_parallel=False)
    sample = Sample(index=7, tokens=[1, 2, 3, 4], response_length=2)
    good = torch.tensor([[[0, 1], [2, 3]]] * 3)
    assert check_record(good.view(3, 4), sample, routers, "r").shape == (3, 2, 2)
    with pytest.raises(DataFormatError, match=r"sample index=7: r has shape \(2, 2, 2\); want one row of num_layers x "
                                              r"topk = 2 x 2 expert ids for each of the 3 fed tokens"):
        check_record(good[:2], sample, routers, "r")
    engine_dense = good.clone()
    engine_dense[:, 1] = -1  # the engine's -1 in a layer without router: fine where this model has none
    check_record(engine_dense, sample, Routers(((0, None),), 2, 8, 2, False), "r")
    with pytest.raises(DataFormatError, match="holds expert id -1 in a MoE layer"):
        check_record(engine_dense, sample, routers, "r")


def test_the_flags_are_config_fields_and_the_rollout_asks_for_routing():
    config = load_config(None, ["--use-rollout-routing-replay", "--use-routing-replay"])
    assert config.algorithm.use_rollout_routing_replay and config.algorithm.use_routing_replay
    assert wants_routed_experts(config.as_namespace())
    assert not wants_routed_experts(load_config(None, ["--use-routing-replay"]).as_namespace())


def test_sglang_engines_must_return_routing():
    with pytest.raises(ConfigError, match="algorithm.use_rollout_routing_replay.*enable_return_routed_experts is "
                                          "false"):
        load_config(None, ["--use-rollout-routing-replay", "--engine", "sglang",
                           "--sglang-enable-return-routed-experts", "false"])


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_random_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe") / "tiny", "tiny")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dense")
    Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=260).save_pretrained(out)  # the config is all a refusal reads
    return out


@pytest.fixture(scope="module")
def replay_rows(moe_dir, dense_dir):
    """One script for the cases that share a Megatron process (each test's own fixture keeps tests short)."""
    return rows_by_case(run_script("routing_replay_run.py", moe_dir, "replayed", "r2", f"errors={dense_dir}",
                                   timeout=300))


def test_routers_use_the_replayed_ids(replay_rows):
    row = replay_rows["replayed"]
    for name in ("plain", "recompute"):  # recompute: each router runs again in the backward (REPLAY_BACKWARD)
        part = row[name]
        assert part["natural_mismatches"] > part["tokens"], part  # random ids: far from the routers' own choice
        assert part["log_prob_mismatches"] == part["train_mismatches"] == 0, part
        assert part["replay_changes_log_probs"] > 1e-3, part
        assert part["cleared"] and part["after_mismatches"] > 0, part  # after a pass the routers route freely


def test_r2_replays_the_log_prob_pass_routing_in_later_steps(replay_rows):
    row = replay_rows["r2"]
    assert row["record_mismatches"] == 0  # the recorded experts are those the pass routed to
    assert row["record_shapes"] == [[9, 2, 2], [10, 2, 2], [10, 2, 2], [10, 2, 2], [4, 2, 2], [13, 2, 2]]
    assert row["record_min"] >= 0
    assert row["drifted_without_replay"] > 0  # the step moved the routers: left alone they route elsewhere
    assert row["second_step_mismatches"] == 0, row  # other micro-batches than the pass's, the same experts
    assert row["train_parts"] != [[i] for i in range(6)]
    assert abs(row["ppo_kl"][0]) < 1e-6  # first step: same weights, same experts, ratio 1


def test_replay_refusals_name_the_problem(replay_rows):
    row = replay_rows["errors"]
    assert "has no experts: drop the flag" in row["dense"] and row["dense"].startswith("ConfigError")
    assert "CUDA graphs" in row["graphs"]
    assert row["valid"] == [[9, 2, 2], [10, 2, 2], [10, 2, 2], [10, 2, 2], [4, 2, 2], [13, 2, 2]]
    assert row["missing"].startswith("DataFormatError: sample index=3: use_rollout_routing_replay")
    assert "has shape (9, 4)" in row["short"] and "each of the 10 fed tokens" in row["short"]
    assert "expert id 8 in a MoE layer; the model has experts 0..7" in row["out_of_range"]
    assert "names an expert twice" in row["repeated"]
    assert "moe_enable_routing_replay" in row["not_built"]
    assert "sample index=0: TrainArrays.routed_experts has 8 rows" in row["rows"]


def test_r3_narrows_the_gap_to_the_engine(moe_dir):
    row = run_script("routing_replay_run.py", moe_dir, "gap", timeout=300)[0]
    without, with_r3 = row["without_r3"], row["with_r3"]
    assert row["routing_flips"] > 0.03 * row["routed_token_layers"]  # the engine's perturbed routers disagree
    assert with_r3["mean_abs_gap"] < 0.2 * without["mean_abs_gap"], row
    assert with_r3["max_abs_gap"] < 0.2 * without["max_abs_gap"], row
    assert abs(with_r3["ppo_kl"]) < 0.2 * abs(without["ppo_kl"]), row


def test_train_rank_replays_the_rollout_routing(moe_dir, tmp_path):
    row = run_script("routing_replay_run.py", moe_dir, f"actor={tmp_path}", timeout=300)[0]
    assert row["asks_engine"]
    assert row["calls"] == {"0": 4, "1": 4} and row["replay_mismatches"] == 0  # old-log-prob pass and both steps
    assert row["refused"].startswith("sample index=4: use_rollout_routing_replay replays")


@pytest.mark.slow  # two rank processes, 23-73 s (passed 2026-11-28); EP parity without replay stays in test_moe.py
def test_expert_parallel_replay_equals_all_experts_on_each_rank(moe_dir):
    ranks = run_ranks(EP_SCRIPT, 2, [str(moe_dir)], timeout=300)
    one, two = ([rows[i] for rows in ranks] for i in (0, 1))
    assert [r["local_experts"] for r in one + two] == [8, 8, 4, 4]
    for a, b in zip(one, two, strict=True):
        assert a["replay_mismatches"] == b["replay_mismatches"] == 0
        for step_a, step_b in zip(a["metrics"], b["metrics"], strict=True):
            assert step_b["loss"] == pytest.approx(step_a["loss"], abs=1e-6)
            assert step_b["grad_norm"] == pytest.approx(step_a["grad_norm"], rel=1e-5)
        for key in ("before", "log_probs"):
            gap = max(abs(x - y) for la, lb in zip(a[key], b[key], strict=True) for x, y in zip(la, lb, strict=True))
            assert gap < 1e-5, (key, gap)
