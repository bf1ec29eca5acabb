"""`sample_seed`: the per-sample `sampling_seed` that makes a resumed rollout draw what an uninterrupted
one drew (end to end: tests/rl/test_sigkill_resume.py)."""

from types import SimpleNamespace

from slime.rollout.generate import sample_seed
from slime.types import Sample


def sample(group_index: int, index: int, response_length: int = 0) -> Sample:
    return Sample(prompt="1+1=", group_index=group_index, index=index, response_length=response_length)


def test_a_seed_depends_on_the_rollout_seed_and_the_sample_ids_only():
    args = SimpleNamespace(rollout_seed=42)
    seeds = [sample_seed(args, sample(g, g * 4 + i)) for g in range(3) for i in range(4)]
    assert len(set(seeds)) == 12 and all(0 <= s < 2**63 for s in seeds)  # SGLang keeps it in an int64
    assert seeds == [sample_seed(SimpleNamespace(rollout_seed=42), sample(g, g * 4 + i))  # another process, rerun
                     for g in range(3) for i in range(4)]
    assert sample_seed(SimpleNamespace(rollout_seed=43), sample(0, 0)) != seeds[0]
    assert sample_seed(args, sample(0, 0), evaluation=True) != seeds[0]  # eval sample 0 is not rollout sample 0
    assert sample_seed(args, sample(0, 0, response_length=3)) != seeds[0]  # a continued partial sample
    assert sample_seed(args, Sample(prompt="x")) is None  # no ids: the engine picks
