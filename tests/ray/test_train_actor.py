"""How a rollout is cut into optimizer steps and data-parallel shares (pure functions, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime.config import Config
from slime.errors import ConfigError, DataFormatError
from slime.ray.train_data import rank_share, steps_per_rollout, total_train_steps


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


def _save_root(root: str, steps: tuple[int, ...]) -> None:
    """A --save root holding a committed (weightless) checkpoint of each of `steps`."""
    from slime.backends.megatron.checkpoint import iteration_dir
    from slime.storage import commit_directory

    for step in steps:
        path = iteration_dir(root, step)
        Path(path).mkdir(parents=True)
        (Path(path) / "weights").write_text(str(step))
        commit_directory(path, "checkpoint")


def test_ref_ckpt_step_picks_that_iteration_of_ref_load(tmp_path):
    from slime.backends.megatron.checkpoint import iteration_dir, reference_checkpoint
    from slime.errors import NotCommittedError

    ref = str(tmp_path / "ref")
    _save_root(ref, (3, 7))
    config = Config.model_validate({"checkpoint": {"ref_load": ref}})
    assert reference_checkpoint(config.checkpoint) == iteration_dir(ref, 7)  # newest
    config.checkpoint.ref_ckpt_step = 3
    assert reference_checkpoint(config.checkpoint) == iteration_dir(ref, 3)
    config.checkpoint.ref_ckpt_step = 5
    with pytest.raises(NotCommittedError, match="checkpoint.ref_ckpt_step 5: .* is not a committed checkpoint"):
        reference_checkpoint(config.checkpoint)


def test_opd_teacher_ckpt_step_picks_that_iteration_of_opd_teacher_load(tmp_path):
    from slime.backends.megatron.checkpoint import iteration_dir, teacher_checkpoint
    from slime.errors import NotCommittedError

    teacher = str(tmp_path / "teacher")
    _save_root(teacher, (2, 4))
    config = Config.model_validate({"checkpoint": {"opd_teacher_load": teacher, "ref_ckpt_step": 2}})
    assert teacher_checkpoint(config.checkpoint) == iteration_dir(teacher, 4)  # newest; ref_ckpt_step is the ref's
    config.checkpoint.opd_teacher_ckpt_step = 2
    assert teacher_checkpoint(config.checkpoint) == iteration_dir(teacher, 2)
    config.checkpoint.opd_teacher_ckpt_step = 3
    with pytest.raises(NotCommittedError, match="checkpoint.opd_teacher_ckpt_step 3: .* is not a committed checkpoint "
                                                r"\(checkpoint.opd_teacher_load must"):
        teacher_checkpoint(config.checkpoint)


def test_balance_data_evens_the_ranks_workloads():
    from slime.ray.train_data import rank_share

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
    from slime.ray.train_data import subsample_rollout

    rows = list(range(24))  # 6 groups of 4
    assert subsample_rollout(rows, 0.5, 4) == [0, 1, 2, 3, 16, 17, 18, 19, 20, 21, 22, 23]  # 3 groups: 1 + 2
    assert subsample_rollout(rows, 1.0, 4) == rows
    with pytest.raises(DataFormatError, match="keeps no group"):
        subsample_rollout(rows, 0.1, 4)


CONVERT = '''
def convert(args, samples):
    """slime's --custom-convert-samples-to-train-data-path signature: its train_data dict, here rewards +1/-1
    by a threshold from args and the first response token left out of the loss."""
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [1.0 if s.reward > args.rollout_temperature / 2 else -1.0 for s in samples],
        "raw_reward": [s.reward for s in samples],
        "loss_masks": [[0] + [1] * (s.response_length - 1) for s in samples],
    }
'''


def test_custom_convert_samples_to_train_data_replaces_rewards_and_masks(make_module, tmp_path):
    from slime.ray.train_actor import TrainActor
    from slime.types import Sample

    module = make_module(CONVERT)
    config = Config.model_validate({"rollout": {"n_samples_per_prompt": 2},
                                    "reward": {"custom_convert_samples_to_train_data_path": f"{module}.convert"}})
    samples = [Sample(group_index=0, index=i, tokens=[1, 2, 3, 4], response_length=2, reward=float(i % 2))
               for i in range(4)]
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    raw, rewards = actor._train_inputs(samples, "mem://r")
    assert rewards == [-1.0, 1.0, -1.0, 1.0] and raw == [0.0, 1.0, 0.0, 1.0]
    assert all(s.loss_mask == [0, 1] for s in samples)
    plain = TrainActor(Config.model_validate({"rollout": {"n_samples_per_prompt": 2}}).model_dump(mode="json"), 0, 1)
    # without the hook: GRPO's (r - mean) / (std + eps) per group of 2, std unbiased: +-1/sqrt(2)
    assert plain._train_inputs(samples, "mem://r")[1] == pytest.approx([-0.70710, 0.70710] * 2, abs=1e-4)


def test_custom_convert_must_return_slimes_train_data():
    from slime.ray.train_data import apply_train_data
    from slime.types import Sample

    samples = [Sample(tokens=[1, 2], response_length=1)]
    with pytest.raises(DataFormatError, match="at least 'rewards', got list"):
        apply_train_data(samples, [1.0], "m.f")
    with pytest.raises(DataFormatError, match=r"train_data\['loss_masks'\] has 2 entries for 1 samples"):
        apply_train_data(samples, {"rewards": [1.0], "loss_masks": [[1], [1]]}, "m.f")
