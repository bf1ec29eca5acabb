"""`outcome` / `outcome_differences`: what a resumed run must reproduce of an uninterrupted run's step record."""

import json

from slime.rl.metrics import ENGINE_ROUNDED_ATOL, outcome, outcome_differences, read_metrics

RECORD = {"rollout_id": 2, "time": 1795306589.1, "weight_version": 3, "async": False, "rl/reward_mean": 0.5,
          "rl/grad_norm": 1.465, "rl/rollout_s": 0.6, "rl/tokens_per_s": 80.0, "train/loss": -0.01,
          "perf/train_time": 1.0, "sync/total_s": 0.2, "sync/bytes": 4100000, "rollout/uri": "/store/a/rollout/000002",
          "eval/tiny/mean_reward": 0.25, "eval/summary_uri": "/store/a/eval/000003-summary/summary.json",
          "rl/logprob_abs_diff": 1.49e-07, "train/train_rollout_logprob_abs_diff": 1.49e-07}


def test_the_outcome_leaves_out_timings_sync_figures_and_uris():
    assert outcome(RECORD) == {"rollout_id": 2, "weight_version": 3, "async": False, "rl/reward_mean": 0.5,
                               "rl/grad_norm": 1.465, "train/loss": -0.01, "eval/tiny/mean_reward": 0.25,
                               "rl/logprob_abs_diff": 1.49e-07, "train/train_rollout_logprob_abs_diff": 1.49e-07}


def test_differences_are_exact_except_the_engine_log_prob_gap():
    other_run = {**RECORD, "time": 1.0, "rl/rollout_s": 9.0, "rollout/uri": "/store/b/rollout/000002",
                 "rl/logprob_abs_diff": 1.09e-07, "train/train_rollout_logprob_abs_diff": 1.09e-07}
    assert outcome_differences(other_run, RECORD) == []
    assert outcome_differences({**RECORD, "rl/grad_norm": 1.4650001}, RECORD) == ["rl/grad_norm: 1.4650001 != 1.465"]
    far = {**RECORD, "rl/logprob_abs_diff": 1.49e-07 + 2 * ENGINE_ROUNDED_ATOL}
    assert len(outcome_differences(far, RECORD)) == 1
    missing = {k: v for k, v in RECORD.items() if k != "eval/tiny/mean_reward"}
    assert outcome_differences(missing, RECORD) == ["eval/tiny/mean_reward: None != 0.25"]


def test_an_eval_line_is_merged_into_its_steps_record_and_an_orphan_is_skipped(tmp_path):
    """A background eval (slime.rl.eval_fleet) ends after its step's line: its own line, merged on read."""
    lines = [{"rollout_id": 0, "time": 1.0, "rl/reward_mean": 0.5},
             {"rollout_id": 1, "time": 2.0, "rl/reward_mean": 0.75},
             {"rollout_id": 0, "record": "eval", "time": 3.0, "eval/rollout_id": 0, "eval/weight_version": 1,
              "eval/checkpoint": "ckpt/iter_0000000", "eval/tiny/mean_reward": 0.25},
             {"rollout_id": 7, "record": "eval", "time": 4.0, "eval/weight_version": 8}]  # no step 7 before it
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = read_metrics(str(path))
    assert sorted(records) == [0, 1]
    assert records[0] == {"rollout_id": 0, "time": 1.0, "rl/reward_mean": 0.5, "eval/rollout_id": 0,
                          "eval/weight_version": 1, "eval/checkpoint": "ckpt/iter_0000000",
                          "eval/tiny/mean_reward": 0.25}  # the step's own time kept
    assert "eval/checkpoint" not in outcome(records[0])  # a path of the run, like a URI
