"""Pipeline parallelism (megatron-core's 1F1B schedule, gloo p2p on CPU): PP 2, TP 2 x PP 2 and PP 2 x DP 2
give the log-probs, losses, gradient norms, PPO critic values and exported weights of TP 1 PP 1 (fp32),
every rank returns the same global metrics, and a PP 2 checkpoint resumes bit-exactly.

Tolerances: losses, log-probs and values 1e-5 absolute, gradient norms 1e-5 relative (TP 2 x PP 2 measured
9.0e-6 absolute, 1.1e-6 relative, on the SFT step's norm of ~8, and 7.2e-5 absolute, 4.5e-7 relative, on the
critic's second step's norm of ~162: the sharded softmax and the stage split sum in another order), exported
weights 1e-6. Measured with PP 2 alone: losses within 5e-7, log-probs 4.8e-7, values after training 7.7e-7.
"""

from pathlib import Path

import pytest
from multirank import run_ranks
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slime.backends.megatron.bridge import model_parallel_sizes
from slime.backends.megatron.forward import prepare_schedule
from slime.errors import ConfigError

SCRIPT = Path(__file__).with_name("pp_parity.py")
LOSS_PARTS = ("loss", "sft_loss", "pg_loss", "entropy_loss", "kl_loss", "ppo_kl", "pg_clipfrac", "value_loss",
              "value_clipfrac")


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def run(mode: str, hf_dir: Path, out: Path, tp: int, pp: int, dp: int = 1) -> list[dict]:
    rows = run_ranks(SCRIPT, world_size=tp * pp * dp, args=[mode, str(hf_dir), str(out), str(tp), str(pp)],
                     timeout=900)
    return [r[0] for r in rows]


def global_metrics(steps: list[dict]) -> list[dict]:
    """The step metrics without this rank's own micro-batch counts and sizes (they differ between
    data-parallel ranks)."""
    return [{k: v for k, v in step.items() if k not in ("num_microbatches", "max_microbatch_tokens")}
            for step in steps]


def per_sample(ranks: list[dict], key: str) -> dict[int, list[float]]:
    """Sample index -> its values, from every rank (the ranks of one data-parallel share must agree)."""
    merged: dict[int, list[float]] = {}
    for rank in ranks:
        for index, values in zip(rank["indices"], rank[key], strict=True):
            assert merged.setdefault(index, values) == values, (key, index)
    return merged


@pytest.mark.slow
def test_pipeline_parallel_equals_one_stage(tiny_kit, tmp_path):
    hf_dir = tiny_kit.model_dir
    one = run("parity", hf_dir, tmp_path, 1, 1)
    initial = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    reference = load_file(tmp_path / "tp1pp1dp1.safetensors")
    assert max((reference[k] - initial[k]).abs().max().item() for k in reference) > 1e-3  # the steps moved them
    for tp, pp, dp in ((1, 2, 1), (2, 2, 1), (1, 2, 2)):
        ranks = run("parity", hf_dir, tmp_path, tp, pp, dp)
        for other in ranks[1:]:  # every rank (first stage included) returns the global metrics
            for key in ("steps", "value_steps"):
                assert global_metrics(other[key]) == global_metrics(ranks[0][key]), (tp, pp, dp, key)
            assert other["exported"] == ranks[0]["exported"]
        got = ranks[0]
        for key in ("log_probs", "entropies", "ref_log_probs", "values", "values_after"):
            want, have = per_sample(one, key), per_sample(ranks, key)
            assert sorted(have) == sorted(want) == list(range(6)), key
            assert max(abs(a - b) for i in want for a, b in zip(want[i], have[i], strict=True)) < 1e-5, \
                (tp, pp, dp, key)
        assert len(got["steps"]) == len(one[0]["steps"]) == 3  # SFT, then two GRPO steps
        assert len(got["value_steps"]) == len(one[0]["value_steps"]) == 2  # the critic's
        for want, have in zip(one[0]["steps"] + one[0]["value_steps"], got["steps"] + got["value_steps"], strict=True):
            assert want.keys() == have.keys()
            for name in LOSS_PARTS:
                if name in want:
                    assert have[name] == pytest.approx(want[name], abs=1e-5), (tp, pp, dp, name)
            assert have["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (tp, pp, dp)
        # each HF name once, in the order of one stage (the tied embedding is not exported twice)
        assert got["exported"] == one[0]["exported"]
        weights = load_file(tmp_path / f"tp{tp}pp{pp}dp{dp}.safetensors")
        assert max((reference[k] - weights[k]).abs().max().item() for k in reference) < 1e-6, (tp, pp, dp)


def test_pipeline_parallel_resume_is_bit_exact_and_its_weights_load_into_one_stage(tiny_kit, tmp_path):
    ranks = run("resume", tiny_kit.model_dir, tmp_path, 1, 2)
    for rank in ranks:
        assert len(rank["resumed"]) == 2
        assert rank["resumed"] == rank["run"][2:]  # weights and Adam state digests, losses: bit-exact
    assert ranks[0]["run"][-1]["weights"] != ranks[1]["run"][-1]["weights"]  # each stage digests its own layers
    assert [s["loss"] for s in ranks[0]["run"]] == [s["loss"] for s in ranks[1]["run"]]
    # the PP 2 checkpoint's weights load into one stage (dist-checkpointing reshards): the same model
    one = run("load", tiny_kit.model_dir, tmp_path, 1, 1)[0]
    saved = ranks[0]["saved_log_probs"]
    assert max(abs(a - b) for a, b in zip(flat(saved), flat(one["log_probs"]), strict=True)) < 1e-6


def test_virtual_pipeline_stages_are_refused():
    with pytest.raises(ConfigError, match="virtual pipeline"):
        prepare_schedule([object(), object()])


def test_parallel_sizes_come_from_the_megatron_section_and_must_divide_the_train_ranks():
    assert model_parallel_sizes({}, 4) == (1, 1)
    assert model_parallel_sizes({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, 8) == (2, 2)
    with pytest.raises(ConfigError, match="6 train ranks cannot be split into tensor_model_parallel_size 2 x "
                                          "pipeline_model_parallel_size 4"):
        model_parallel_sizes({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4}, 6)
    with pytest.raises(ConfigError, match="the SFT stage trains on one rank"):
        model_parallel_sizes({"pipeline_model_parallel_size": 2}, 1, "the SFT stage trains on one rank")
