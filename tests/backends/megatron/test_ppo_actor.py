"""PPO on a real train rank (ppo_actor.py, fp32 on CPU, --num-critic-only-steps 2, the same batch every rollout):
the critic trains every rollout and its value loss falls; during the critic-only rollouts the actor's weights do
not move (train/actor_skipped 1), from rollout 2 they do; a rank resumed from the checkpoint saved after rollout 1
(actor, critic and both optimizers) reproduces rollouts 2 and 3 of the uninterrupted run exactly."""

import pytest
from script_rows import run_script


@pytest.mark.slow  # 50-110 s on 2 shared cores: two rank processes, six train calls
def test_ppo_critic_only_steps_then_actor_and_bit_exact_resume(tiny_kit, tmp_path):
    run = {row["case"]: row for row in run_script("ppo_actor.py", tiny_kit.model_dir, tmp_path, "run", timeout=600)}
    assert sorted(run) == [0, 1, 2, 3]
    for rollout_id, row in run.items():
        m = row["metrics"]
        assert row["critic_change"] > 0, row  # the critic trains every rollout
        assert m["train/critic-grad_norm"] > 0 and 0 <= m["train/value_clipfrac"] <= 1, m
        skipped = rollout_id < 2
        assert m["train/actor_skipped"] == float(skipped), m
        if skipped:  # critic-only: the actor neither steps nor reports a policy loss
            assert row["actor_change"] == 0.0 and "train/grad_norm" not in m and "train/pg_loss" not in m, row
        else:
            assert row["actor_change"] > run[rollout_id - 1]["actor_change"] and m["train/grad_norm"] > 0, row
            assert "rollout/advantages" in m and "train/pg_loss" in m, m
    # the values move between rollouts, and on a fixed batch the critic fits it (Adam wobbles at first)
    assert len({row["value_mean"] for row in run.values()}) == 4
    losses = [run[i]["metrics"]["train/value_loss"] for i in range(4)]
    assert losses[3] < losses[2] < losses[1] and losses[3] < losses[0] / 4, losses

    resumed = run_script("ppo_actor.py", tiny_kit.model_dir, tmp_path, "resume", timeout=600)
    assert [row["case"] for row in resumed] == [2, 3] and resumed[0]["resumed_at"] == 2
    for row in resumed:  # bit for bit: the actor's and the critic's metrics, and the critic's values after
        assert row["metrics"] == run[row["case"]]["metrics"], row["case"]
        assert row["value_mean"] == run[row["case"]]["value_mean"], row["case"]
