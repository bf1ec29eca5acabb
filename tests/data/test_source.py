"""Tests for slime.data.source: group ids, epoch order, the buffer, and exact resume from saved state."""

from __future__ import annotations

import json
import random

import pytest

from slime.config import Config
from slime.data.source import RolloutDataSource, epoch_order, pop_first
from slime.errors import ConfigError, DataFormatError
from slime.plugins import PluginError
from slime.types import Sample


def make_prompts(n: int) -> list[Sample]:
    """Prompts shaped like `load_prompts` output: index == group_index == row number."""
    return [Sample(index=i, group_index=i, prompt=f"q{i}", label=str(i), metadata={"row": i}) for i in range(n)]


def labels(groups: list[list[Sample]]) -> list[str]:
    return [group[0].label for group in groups]


def as_dicts(batches: list[list[list[Sample]]]) -> list:
    return [[[s.to_dict() for s in group] for group in batch] for batch in batches]


def draw(source: RolloutDataSource, batches: int, size: int) -> list[list[list[Sample]]]:
    return [source.get_samples(size) for _ in range(batches)]


def partial_group(source: RolloutDataSource, tag: str) -> list[Sample]:
    """A group as partial rollout would put it back: ids already assigned, some output generated."""
    group = []
    for k in range(source.n_samples_per_prompt):
        group.append(
            Sample(group_index=900, index=900 + k, prompt=f"p-{tag}", label=tag, tokens=[1, 2, 3 + k],
                   response="par", response_length=1, loss_mask=[1], rollout_log_probs=[-0.5],
                   status=Sample.Status.ABORTED, metadata={"tag": tag}, weight_versions=["3"])
        )
    return group


# ----------------------------------------------------------------------------- groups and ids


def test_groups_and_ids_hand_checked():
    # 3 prompts, 2 samples each, no shuffle. Draw 2 groups, then 2 more (wrapping into epoch 1):
    #   batch 1: q0 -> group 0 (index 0, 1); q1 -> group 1 (index 2, 3)
    #   batch 2: q2 -> group 2 (index 4, 5); q0 -> group 3 (index 6, 7)   (epoch 1, offset 1)
    source = RolloutDataSource(make_prompts(3), n_samples_per_prompt=2)
    first, second = source.get_samples(2), source.get_samples(2)
    ids = [[(s.prompt, s.group_index, s.index) for s in g] for g in first + second]
    assert ids == [
        [("q0", 0, 0), ("q0", 0, 1)],
        [("q1", 1, 2), ("q1", 1, 3)],
        [("q2", 2, 4), ("q2", 2, 5)],
        [("q0", 3, 6), ("q0", 3, 7)],
    ]
    assert (source.epoch_id, source.sample_offset) == (1, 1)
    assert all(s.status is Sample.Status.PENDING for g in first for s in g)


def test_samples_are_independent_copies():
    prompts = make_prompts(2)
    source = RolloutDataSource(prompts, n_samples_per_prompt=2)
    group = source.get_samples(1)[0]
    group[0].metadata["touched"] = True
    group[0].tokens.append(7)
    assert "touched" not in group[1].metadata and group[1].tokens == []
    assert prompts[0].metadata == {"row": 0} and prompts[0].index == 0


def test_request_larger_than_dataset_wraps_several_epochs():
    source = RolloutDataSource(make_prompts(3))
    assert labels(source.get_samples(8)) == ["0", "1", "2", "0", "1", "2", "0", "1"]
    assert (source.epoch_id, source.sample_offset, source.sample_group_index) == (2, 2, 8)
    assert source.get_samples(0) == []


# ----------------------------------------------------------------------------- epoch order


def test_every_prompt_once_per_epoch_and_reshuffled():
    source = RolloutDataSource(make_prompts(7), shuffle=True, seed=3)
    order = labels([g for batch in draw(source, 7, 3) for g in batch])  # 21 groups = 3 epochs
    epochs = [order[0:7], order[7:14], order[14:21]]
    for epoch in epochs:
        assert sorted(epoch, key=int) == [str(i) for i in range(7)]
    assert len({tuple(e) for e in epochs}) == 3  # each epoch has its own order
    assert epochs[0] != [str(i) for i in range(7)]


def test_shuffle_determinism_by_seed():
    def sequence(seed: int) -> list[str]:
        source = RolloutDataSource(make_prompts(10), shuffle=True, seed=seed)
        return labels([g for batch in draw(source, 5, 4) for g in batch])

    assert sequence(11) == sequence(11)
    assert sequence(11) != sequence(12)


def test_epoch_order_matches_slime_global_random_shuffle():
    # slime's Dataset.shuffle: random.seed(seed + epoch); random.shuffle(list(range(n))).
    saved = random.getstate()
    try:
        for epoch in range(3):
            random.seed(42 + epoch)
            expected = list(range(20))
            random.shuffle(expected)
            assert epoch_order(20, True, 42, epoch) == expected
    finally:
        random.setstate(saved)
    assert epoch_order(5, False, 42, 3) == [0, 1, 2, 3, 4]


def test_rollouts_per_epoch():
    source = RolloutDataSource(make_prompts(10))
    assert source.rollouts_per_epoch(3) == 3
    assert source.rollouts_per_epoch(10) == 1
    assert source.rollouts_per_epoch(25) == 1  # one step, prompts repeat within it
    with pytest.raises(ConfigError):
        source.rollouts_per_epoch(0)


# ----------------------------------------------------------------------------- buffer


def test_buffer_drained_first_with_pop_first():
    source = RolloutDataSource(make_prompts(5), n_samples_per_prompt=2)
    a, b, c = (partial_group(source, t) for t in "abc")
    source.add_samples([a, b])
    source.add_samples([c])
    batch = source.get_samples(2)
    assert batch == [a, b]  # buffer groups come back as they were put in, ids untouched
    assert source.sample_group_index == 0  # no fresh prompt consumed
    batch = source.get_samples(3)
    assert labels(batch) == ["c", "0", "1"]
    assert [s.index for s in batch[1]] == [0, 1]
    assert source.buffer == []


def test_add_samples_rejects_bad_groups():
    source = RolloutDataSource(make_prompts(2), n_samples_per_prompt=2)
    with pytest.raises(DataFormatError, match="group 0 has 1 samples; n_samples_per_prompt is 2"):
        source.add_samples([[Sample()]])
    with pytest.raises(DataFormatError, match="group 1 must be a list of Sample"):
        source.add_samples([[Sample(), Sample()], ["x", "y"]])
    assert source.buffer == []


def test_pop_first_contract():
    buffer = [[Sample(index=i)] for i in range(3)]
    assert [g[0].index for g in pop_first(None, None, buffer, 2)] == [0, 1]
    assert [g[0].index for g in buffer] == [2]
    assert len(pop_first(None, None, buffer, 5)) == 1 and buffer == []


def test_custom_buffer_filter_by_dotted_path(make_module):
    mod = make_module(
        """
        CALLS = []

        def pop_last(args, rollout_id, buffer, num_groups):
            CALLS.append((args, rollout_id, num_groups))
            taken = buffer[-num_groups:][::-1]
            del buffer[-num_groups:]
            return taken
        """
    )
    args = object()
    source = RolloutDataSource(make_prompts(4), buffer_filter_path=f"{mod}.pop_last", args=args)
    groups = [partial_group(source, t) for t in "abc"]
    source.add_samples(groups)
    assert labels(source.get_samples(2, rollout_id=5)) == ["c", "b"]
    assert labels(source.get_samples(2, rollout_id=6)) == ["a", "0"]
    calls = __import__(mod).CALLS
    assert calls == [(args, 5, 2), (args, 6, 2)]


def test_buffer_filter_checked_at_construction_and_at_use(make_module):
    mod = make_module(
        """
        def three_params(args, buffer, num_groups):
            return []

        async def is_async(args, rollout_id, buffer, num_groups):
            return []

        def greedy(args, rollout_id, buffer, num_groups):
            return list(buffer)
        """
    )
    with pytest.raises(PluginError, match="three_params"):
        RolloutDataSource(make_prompts(2), buffer_filter_path=f"{mod}.three_params")
    with pytest.raises(PluginError, match="not `async def`"):
        RolloutDataSource(make_prompts(2), buffer_filter_path=f"{mod}.is_async")
    source = RolloutDataSource(make_prompts(2), buffer_filter_path=f"{mod}.greedy")
    source.add_samples([partial_group(source, t) for t in "abc"])
    with pytest.raises(ValueError, match=r"greedy' must return a list of at most 2 groups, got 3 groups"):
        source.get_samples(2)


# ----------------------------------------------------------------------------- save / restore


def build(n_samples: int = 2) -> RolloutDataSource:
    return RolloutDataSource(make_prompts(6), n_samples_per_prompt=n_samples, shuffle=True, seed=5)


@pytest.mark.parametrize(
    "batches_before",
    [1, 2, 3],  # batch size 3 of 6 prompts: mid epoch 0, exactly at the epoch end, mid epoch 1
)
@pytest.mark.parametrize("with_buffer", [False, True])
def test_restore_continues_exactly(tmp_path, batches_before, with_buffer):
    original = build()
    draw(original, batches_before, 3)
    if with_buffer:
        original.add_samples([partial_group(original, "x"), partial_group(original, "y")])
    if batches_before == 2:
        assert (original.epoch_id, original.sample_offset) == (0, 6)
    path = tmp_path / "ckpt" / "data_source.json"
    original.save(path)

    restored = build()
    restored.load(path)
    expected = as_dicts(draw(original, 3, 3))
    assert as_dicts(draw(restored, 3, 3)) == expected
    assert restored.state_dict() == original.state_dict()


def test_restored_epoch_order_differs_from_epoch_zero():
    # Guards the test above: resuming in epoch 1 must not replay epoch 0's permutation.
    assert epoch_order(6, True, 5, 1) != epoch_order(6, True, 5, 0)


def test_state_dict_is_json_and_round_trips():
    source = build()
    draw(source, 2, 4)
    source.add_samples([partial_group(source, "z")])
    state = source.state_dict()
    assert state["buffer"][0][0]["status"] == "aborted"
    assert {k: state[k] for k in ("epoch_id", "sample_offset", "sample_group_index", "sample_index")} == {
        "epoch_id": 1, "sample_offset": 2, "sample_group_index": 8, "sample_index": 16,
    }
    text = json.dumps(state)
    other = build()
    other.load_state_dict(json.loads(text))
    assert other.state_dict() == state
    assert as_dicts([other.get_samples(4)]) == as_dicts([source.get_samples(4)])


def test_state_dict_does_not_alias_buffer():
    source = build()
    source.add_samples([partial_group(source, "z")])
    state = source.state_dict()
    source.buffer[0][0].tokens.append(99)
    assert state["buffer"][0][0]["tokens"] == [1, 2, 3]


def test_save_is_atomic_json_file(tmp_path):
    source = build()
    draw(source, 1, 2)
    path = tmp_path / "state.json"
    source.save(path)
    source.save(path)  # overwrite in place
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    assert json.loads(path.read_text())["sample_offset"] == 2


def test_save_unserialisable_buffer_names_file_and_writes_nothing(tmp_path):
    source = build(n_samples=1)
    source.add_samples([[Sample(metadata={"bad": object()})]])
    path = tmp_path / "state.json"
    with pytest.raises(DataFormatError, match="state.json: data source state is not JSON-serialisable"):
        source.save(path)
    assert list(tmp_path.iterdir()) == []


def good_state() -> dict:
    source = build()
    source.get_samples(3)
    source.add_samples([partial_group(source, "b")])
    return source.state_dict()


@pytest.mark.parametrize(
    ("edit", "error", "pattern"),
    [
        (lambda s: s.update(version=2), DataFormatError, "field 'version' is 2; this code reads version 1"),
        (lambda s: s.pop("sample_offset"), DataFormatError, r"missing field\(s\) \['sample_offset'\]"),
        (lambda s: s.update(sample_index=-1), DataFormatError, "field 'sample_index' must be a non-negative"),
        (lambda s: s.update(epoch_id="1"), DataFormatError, "field 'epoch_id' must be a non-negative"),
        (lambda s: s.update(shuffle="yes"), DataFormatError, "field 'shuffle' must be true or false"),
        (lambda s: s.update(sample_offset=7), DataFormatError, "field 'sample_offset' is 7, past num_prompts=6"),
        (lambda s: s["buffer"][0].pop(), DataFormatError, r"field 'buffer\[0\]' must be a list of 2 samples"),
        (lambda s: s["buffer"][0][1].update(colour=1), DataFormatError, r"buffer\[0\]'.*unknown field"),
        (lambda s: s.update(buffer={}), DataFormatError, "field 'buffer' must be a list"),
        (lambda s: s.update(num_prompts=5), ConfigError, "field 'num_prompts' is 5 but this data source has 6"),
        (lambda s: s.update(seed=6), ConfigError, "field 'seed' is 6 but this data source has 5"),
        (lambda s: s.update(n_samples_per_prompt=4), ConfigError, "field 'n_samples_per_prompt' is 4"),
    ],
)
def test_bad_state_file_names_file_and_field(tmp_path, edit, error, pattern):
    state = good_state()
    edit(state)
    path = tmp_path / "bad_state.json"
    path.write_text(json.dumps(state))
    source = build()
    before = source.state_dict()
    with pytest.raises(error, match=pattern) as info:
        source.load(path)
    assert str(path) in str(info.value)
    assert source.state_dict() == before  # a failed load changes nothing


@pytest.mark.parametrize("content", [b'{"version": 1, "epoch', b"\xff\xfe garbage", b"[1, 2]"])
def test_corrupt_state_file(tmp_path, content):
    path = tmp_path / "corrupt.json"
    path.write_bytes(content)
    with pytest.raises(DataFormatError, match="corrupt.json"):
        build().load(path)


# ----------------------------------------------------------------------------- from_config


def test_from_config(tmp_path, make_module):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(4)))
    mod = make_module(
        """
        SEEN = []

        def record(args, rollout_id, buffer, num_groups):
            SEEN.append(args.n_samples_per_prompt)
            taken = buffer[:num_groups]
            del buffer[:num_groups]
            return taken
        """
    )
    config = Config(
        data={"prompt_data": str(data), "rollout_shuffle": True},
        rollout={"n_samples_per_prompt": 3, "rollout_seed": 9, "buffer_filter_path": f"{mod}.record"},
    )
    source = RolloutDataSource.from_config(config)
    assert (len(source), source.n_samples_per_prompt, source.shuffle, source.seed) == (4, 3, True, 9)
    assert labels(source.get_samples(4)) == [str(i) for i in epoch_order(4, True, 9, 0)]
    source.add_samples([partial_group(source, "p")])
    source.get_samples(1)
    assert __import__(mod).SEEN == [3]


def test_from_config_needs_prompt_data():
    with pytest.raises(ConfigError, match="data.prompt_data"):
        RolloutDataSource.from_config(Config())


def test_empty_prompts_rejected():
    with pytest.raises(ConfigError, match="at least one prompt"):
        RolloutDataSource([])


SLIME_SOURCE = '''
from slime.types import Sample


class Counting:
    """A data source written to slime's DataSource interface: cls(args), get_samples(num_samples)."""

    def __init__(self, args):
        self.n, self.next = args.n_samples_per_prompt, 0
        self.added = []

    def get_samples(self, num_samples):
        groups = []
        for _ in range(num_samples):
            groups.append([Sample(prompt=f"q{self.next}", index=self.next * self.n + i) for i in range(self.n)])
            self.next += 1
        return groups

    def add_samples(self, samples):
        self.added.extend(samples)

    def __len__(self):
        return 100

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]
'''


def test_data_source_path_builds_a_slime_data_source_class(make_module):
    from slime.config import load_config
    from slime.data.source import CustomDataSource, make_data_source

    module = make_module(SLIME_SOURCE)
    config = load_config(None, ["--data-source-path", f"{module}.Counting", "--n-samples-per-prompt", "2"])
    source = make_data_source(config)
    assert isinstance(source, CustomDataSource) and len(source) == 100
    groups = source.get_samples(2, rollout_id=0)  # this project's call; slime's class takes only the count
    assert [[s.prompt for s in g] for g in groups] == [["q0", "q0"], ["q1", "q1"]]
    state = json.loads(json.dumps(source.state_dict()))
    assert state["num_prompts"] == 100 and state["state"] == {"next": 2}
    source.get_samples(3)
    source.load_state_dict(state)
    assert source.get_samples(1)[0][0].prompt == "q2"  # resumed at the saved cursor
    source.add_samples(groups)
    assert source.inner.added == groups


def test_data_source_path_checks_the_interface(make_module):
    from slime.config import load_config
    from slime.data.source import make_data_source
    from slime.plugins import PluginError

    module = make_module("class Half:\n    def __init__(self, args):\n        pass\n\n"
                         "    def get_samples(self, n):\n        return [[1]]\n")
    with pytest.raises(PluginError, match=r"lacks \['add_samples', '__len__'\]"):
        make_data_source(load_config(None, ["--data-source-path", f"{module}.Half"]))


def test_without_the_global_dataset_groups_are_empty_samples():
    from slime.config import load_config
    from slime.data.source import make_data_source

    config = load_config(None, ["--disable-rollout-global-dataset", "--rollout-function-path", "m.rollout",
                                "--n-samples-per-prompt", "2"])
    source = make_data_source(config)
    groups = source.get_samples(2)
    assert [[(s.prompt, s.group_index, s.index) for s in g] for g in groups] == \
        [[("", 0, 0), ("", 0, 1)], [("", 1, 2), ("", 1, 3)]]
    assert len(source) == 0 and source.state_dict()["sample_index"] == 4
    with pytest.raises(ConfigError, match="default rollout draws prompts from the global dataset"):
        load_config(None, ["--disable-rollout-global-dataset"])
