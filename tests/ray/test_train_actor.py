"""How a rollout is cut into optimizer steps and data-parallel shares (pure functions, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime.config import Config
from slime.errors import ConfigError, DataFormatError
from slime.ray.train_actor import rank_share, steps_per_rollout, total_train_steps


def _config(**train) -> Config:
    return Config.model_validate({"rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4,
                                              "num_rollout": 10}, "train": train})


def test_steps_from_global_batch_size_or_count():
    assert steps_per_rollout(_config(global_batch_size=8), 16) == 2
    assert steps_per_rollout(_config(global_batch_size=8), 20) == 2  # remainder dropped, as in slime
    assert steps_per_rollout(_config(num_steps_per_rollout=4), 16) == 4
    assert steps_per_rollout(_config(), 16) == 1
    with pytest.raises(DataFormatError, match="6 samples, fewer than global_batch_size 8"):
        steps_per_rollout(_config(global_batch_size=8), 6)


def test_total_steps_sizes_the_lr_schedule():
    assert total_train_steps(_config(global_batch_size=4)) == 10 * 4
    assert total_train_steps(Config()) is None  # num_rollout unknown


def test_each_step_is_split_round_robin_over_ranks():
    samples = list(range(10))  # 2 steps of 5 would not split over 2 ranks; 20 // 2 steps of 10 do
    shares = [rank_share(list(range(20)), 2, rank, 2) for rank in range(2)]
    assert shares[0] == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18]]
    assert shares[1] == [[1, 3, 5, 7, 9], [11, 13, 15, 17, 19]]
    assert rank_share(samples, 1, 0, 1) == [samples]
    with pytest.raises(ConfigError, match="5 samples per optimizer step cannot be split over 2"):
        rank_share(samples, 2, 0, 2)


def test_ref_ckpt_step_picks_that_iteration_of_ref_load(tmp_path):
    from slime.backends.megatron.checkpoint import iteration_dir
    from slime.errors import NotCommittedError
    from slime.ray.train_actor import TrainActor
    from slime.storage import commit_directory

    ref = str(tmp_path / "ref")
    for step in (3, 7):
        path = iteration_dir(ref, step)
        Path(path).mkdir(parents=True)
        (Path(path) / "weights").write_text(str(step))
        commit_directory(path, "checkpoint")
    config = Config.model_validate({"checkpoint": {"ref_load": ref}})
    assert TrainActor(config.model_dump(mode="json"), 0, 1)._ref_checkpoint() == iteration_dir(ref, 7)  # newest
    config.checkpoint.ref_ckpt_step = 3
    assert TrainActor(config.model_dump(mode="json"), 0, 1)._ref_checkpoint() == iteration_dir(ref, 3)
    config.checkpoint.ref_ckpt_step = 5
    with pytest.raises(NotCommittedError, match="ref_ckpt_step 5: .* is not a committed checkpoint"):
        TrainActor(config.model_dump(mode="json"), 0, 1)._ref_checkpoint()


def test_balance_data_evens_the_ranks_workloads():
    from slime.ray.train_actor import rank_share

    # one step of 8 samples over 2 ranks; strided shares cost 10+1+9+3 = 23 and 1+1+2+3 = 7
    costs = [10.0, 1.0, 1.0, 1.0, 9.0, 2.0, 3.0, 3.0]
    strided = [rank_share(list(range(8)), 1, rank, 2)[0] for rank in range(2)]
    balanced = [rank_share(list(range(8)), 1, rank, 2, costs)[0] for rank in range(2)]
    assert [sum(costs[i] for i in share) for share in strided] == [23.0, 7.0]
    assert [sum(costs[i] for i in share) for share in balanced] == [15.0, 15.0]
    assert sorted(balanced[0] + balanced[1]) == list(range(8)) and [len(s) for s in balanced] == [4, 4]
    # two steps: each is partitioned on its own (indices stay inside their step)
    two = [rank_share(list(range(8)), 2, rank, 2, costs) for rank in range(2)]
    assert sorted(two[0][0] + two[1][0]) == [0, 1, 2, 3] and sorted(two[0][1] + two[1][1]) == [4, 5, 6, 7]


def test_debug_rollout_subsample_keeps_whole_groups_from_both_ends():
    from slime.ray.train_actor import subsample_rollout

    rows = list(range(24))  # 6 groups of 4
    assert subsample_rollout(rows, 0.5, 4) == [0, 1, 2, 3, 16, 17, 18, 19, 20, 21, 22, 23]  # 3 groups: 1 + 2
    assert subsample_rollout(rows, 1.0, 4) == rows
    with pytest.raises(DataFormatError, match="keeps no group"):
        subsample_rollout(rows, 0.1, 4)
