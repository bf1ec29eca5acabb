"""`RolloutDataSource`: the prompt cursor that feeds rollout, plus slime's partial-rollout buffer.

Behaviour follows THUDM/slime's `RolloutDataSourceWithBuffer` (`slime/rollout/data_source.py`):
`get_samples(n)` returns `n` groups of `n_samples_per_prompt` deep copies of the next prompts, with
`group_index` counting prompts and `index` counting samples over the whole run; groups put back
with `add_samples` (aborted partial rollouts) are handed out first, chosen by the buffer filter
`fn(args, rollout_id, buffer, num_groups)` (default `pop_first`). With shuffling on, epoch `e` visits
the prompts in the order `random.Random(seed + e).shuffle(range(N))`, the permutation slime's
`Dataset.shuffle` draws from the global `random` module.

Epochs wrap forever: the source never runs out, and the caller decides how many rollouts to run
(`rollouts_per_epoch` helps compute slime's `num_rollout = N // rollout_batch_size * num_epoch`).

Departures from slime:
* one class instead of a base class and a buffered subclass;
* the buffer is saved with the cursor (slime drops it), so a resumed run draws exactly the groups an
  uninterrupted run would have drawn;
* state is versioned JSON written atomically, not a `torch.save` pickle, and loading it checks that
  it was written for the same dataset size and sampling settings;
* a request for more groups than the dataset holds wraps as many epochs as needed (slime wraps once).

`data.disable_rollout_global_dataset` (slime's flag) leaves the prompt data out: groups are copies of an
empty `Sample()` with fresh ids, which a custom rollout function fills. `data.data_source_path` names a
data-source class written to slime's interface instead (`cls(args)`, `get_samples(num_samples)`,
`add_samples(groups)`, `__len__`); `make_data_source` builds either, and `CustomDataSource` gives such a
class this project's calls (`get_samples(n, rollout_id)`, JSON `state_dict()` for resume).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import tempfile
from pathlib import Path
from typing import Any

from slime.data.prompts import load_prompts
from slime.errors import ConfigError, DataFormatError
from slime.plugins import PluginError, check_signature, load_function
from slime.types import Sample

STATE_VERSION = 1
DEFAULT_BUFFER_FILTER = "slime.data.source.pop_first"
DEFAULT_DATA_SOURCE = "slime.data.source.RolloutDataSource"
BUFFER_FILTER_PARAMS = ["args", "rollout_id", "buffer", "num_groups"]

# Integer fields of the state (all but seed non-negative); the first four are slime's cursor names.
_INT_FIELDS = (
    "epoch_id", "sample_offset", "sample_group_index", "sample_index", "num_prompts", "n_samples_per_prompt", "seed"
)


def pop_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """Default buffer filter: remove and return the oldest `num_groups` groups (all, if fewer)."""
    taken = buffer[:num_groups]
    del buffer[:num_groups]
    return taken


def epoch_order(num_prompts: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Prompt indices in the order epoch `epoch` visits them."""
    order = list(range(num_prompts))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


class RolloutDataSource:
    """Hands out groups of samples: buffered leftovers first, then fresh prompts, epoch after epoch.

    Args:
        prompts: one PENDING `Sample` per prompt, as `load_prompts` returns them (never mutated).
        n_samples_per_prompt: samples per group (GRPO's group size).
        shuffle: reshuffle the prompts at the start of every epoch (seeded by `seed + epoch`).
        seed: shuffle seed (`rollout.rollout_seed`).
        buffer_filter_path: dotted path of `fn(args, rollout_id, buffer, num_groups) -> list[group]`,
            which must remove the groups it returns from `buffer`; None means `pop_first`.
        args: the flat namespace passed to the buffer filter as `args` (`Config.as_namespace()`).
        global_dataset: False (slime's --disable-rollout-global-dataset): no prompts; groups of empty samples.
    """

    def __init__(
        self,
        prompts: list[Sample],
        *,
        n_samples_per_prompt: int = 1,
        shuffle: bool = False,
        seed: int = 42,
        buffer_filter_path: str | None = None,
        args: Any = None,
        global_dataset: bool = True,
    ) -> None:
        if not prompts and global_dataset:
            raise ConfigError("RolloutDataSource needs at least one prompt")
        self.global_dataset = global_dataset
        if n_samples_per_prompt < 1:
            raise ConfigError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.prompts = list(prompts)
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.args = args
        self.buffer_filter_path = buffer_filter_path or DEFAULT_BUFFER_FILTER
        self.buffer_filter = load_function(self.buffer_filter_path)
        check_signature(self.buffer_filter, self.buffer_filter_path, BUFFER_FILTER_PARAMS, is_async=False)
        self.buffer: list[list[Sample]] = []
        self.epoch_id = 0
        self.sample_offset = 0  # prompts of the current epoch already handed out
        self.sample_group_index = 0  # next group_index
        self.sample_index = 0  # next index
        self._order = epoch_order(len(self.prompts), shuffle, seed, 0)

    @classmethod
    def from_config(cls, config: Any, tokenizer: Any = None) -> RolloutDataSource:
        """Load `data.prompt_data` and build the source from the `data` and `rollout` sections.

        `tokenizer` is needed only for `data.apply_chat_template` or `data.rollout_max_prompt_len`.
        """
        data, rollout = config.data, config.rollout
        if data.disable_rollout_global_dataset:
            return cls([], n_samples_per_prompt=rollout.n_samples_per_prompt, seed=rollout.rollout_seed,
                       buffer_filter_path=rollout.buffer_filter_path, args=config.as_namespace(),
                       global_dataset=False)
        config.require("data.prompt_data", stage="rollout")
        prompts = load_prompts(
            data.prompt_data,
            input_key=data.input_key,
            label_key=data.label_key,
            metadata_key=data.metadata_key,
            tool_key=data.tool_key,
            tokenizer=tokenizer,
            apply_chat_template=data.apply_chat_template,
            apply_chat_template_kwargs=data.apply_chat_template_kwargs or None,
            max_prompt_len=data.rollout_max_prompt_len,
        )
        return cls(
            prompts,
            n_samples_per_prompt=rollout.n_samples_per_prompt,
            shuffle=data.rollout_shuffle,
            seed=rollout.rollout_seed,
            buffer_filter_path=rollout.buffer_filter_path,
            args=config.as_namespace(),
        )

    def __len__(self) -> int:
        """Number of prompts in one epoch."""
        return len(self.prompts)

    def rollouts_per_epoch(self, rollout_batch_size: int) -> int:
        """Rollout steps of `rollout_batch_size` groups per epoch: `N // rollout_batch_size`, at least 1
        (a batch larger than the dataset still makes one step; its prompts repeat)."""
        if rollout_batch_size < 1:
            raise ConfigError(f"rollout_batch_size must be >= 1, got {rollout_batch_size}")
        return max(1, len(self.prompts) // rollout_batch_size)

    # ------------------------------------------------------------------ drawing groups

    def get_samples(self, num_groups: int, rollout_id: int | None = None) -> list[list[Sample]]:
        """The next `num_groups` groups: from the buffer first (via the filter), then fresh prompts."""
        if num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}")
        groups = self._take_from_buffer(num_groups, rollout_id)
        groups += [self._fan_out(prompt) for prompt in self._next_prompts(num_groups - len(groups))]
        return groups

    def _take_from_buffer(self, num_groups: int, rollout_id: int | None) -> list[list[Sample]]:
        if not self.buffer or num_groups == 0:
            return []
        taken = self.buffer_filter(self.args, rollout_id, self.buffer, num_groups)
        if not isinstance(taken, list) or len(taken) > num_groups:
            got = f"{len(taken)} groups" if isinstance(taken, list) else type(taken).__name__
            raise ValueError(
                f"buffer filter {self.buffer_filter_path!r} must return a list of at most {num_groups} "
                f"groups, got {got}"
            )
        return list(taken)

    def _next_prompts(self, count: int) -> list[Sample]:
        """The next `count` prompts of the epoch order, starting new epochs as needed."""
        if not self.global_dataset:  # slime: no dataset, the rollout function makes the prompts
            return [Sample() for _ in range(count)]
        taken: list[Sample] = []
        while len(taken) < count:
            if self.sample_offset == len(self.prompts):  # epoch finished: start the next lazily
                self.epoch_id += 1
                self.sample_offset = 0
                self._order = epoch_order(len(self.prompts), self.shuffle, self.seed, self.epoch_id)
            stop = min(len(self.prompts), self.sample_offset + count - len(taken))
            taken += [self.prompts[i] for i in self._order[self.sample_offset : stop]]
            self.sample_offset = stop
        return taken

    def _fan_out(self, prompt: Sample) -> list[Sample]:
        """`n_samples_per_prompt` independent copies of `prompt` with fresh global ids."""
        group = []
        for _ in range(self.n_samples_per_prompt):
            sample = copy.deepcopy(prompt)
            sample.group_index = self.sample_group_index
            sample.index = self.sample_index
            self.sample_index += 1
            group.append(sample)
        self.sample_group_index += 1
        return group

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Put groups back (e.g. aborted partial rollouts); `get_samples` hands them out first."""
        if not isinstance(groups, list):
            raise DataFormatError(f"add_samples expects a list of groups, got {type(groups).__name__}")
        for i, group in enumerate(groups):
            if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group):
                raise DataFormatError(f"add_samples: group {i} must be a list of Sample, got {group!r:.80}")
            if len(group) != self.n_samples_per_prompt:
                raise DataFormatError(
                    f"add_samples: group {i} has {len(group)} samples; n_samples_per_prompt is "
                    f"{self.n_samples_per_prompt}"
                )
        self.buffer.extend(groups)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible snapshot: the cursor, the settings it depends on, and the buffer.

        The epoch order is not stored: it is recomputed from (`seed`, `epoch_id`, `num_prompts`).
        """
        return {
            "version": STATE_VERSION,
            "epoch_id": self.epoch_id,
            "sample_offset": self.sample_offset,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "num_prompts": len(self.prompts),
            "n_samples_per_prompt": self.n_samples_per_prompt,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "buffer": copy.deepcopy([[s.to_dict() for s in group] for group in self.buffer]),
        }

    def load_state_dict(self, state: Any, *, where: str = "data source state") -> None:
        """Restore a `state_dict()`. Nothing changes if it is malformed (`DataFormatError`) or was
        written for another dataset size or sampling settings (`ConfigError`); `where` names the
        source (file) in the messages."""
        if not isinstance(state, dict):
            raise DataFormatError(f"{where}: expected a JSON object, got {type(state).__name__}")
        missing = [k for k in ("version", *_INT_FIELDS, "shuffle", "buffer") if k not in state]
        if missing:
            raise DataFormatError(f"{where}: missing field(s) {missing}")
        if state["version"] != STATE_VERSION:
            raise DataFormatError(
                f"{where}: field 'version' is {state['version']!r}; this code reads version {STATE_VERSION}"
            )
        for key in _INT_FIELDS:
            value = state[key]
            if type(value) is not int or (value < 0 and key != "seed"):
                kind = "an integer" if key == "seed" else "a non-negative integer"
                raise DataFormatError(f"{where}: field {key!r} must be {kind}, got {value!r}")
        if type(state["shuffle"]) is not bool:
            raise DataFormatError(f"{where}: field 'shuffle' must be true or false, got {state['shuffle']!r}")
        if state["sample_offset"] > state["num_prompts"]:
            raise DataFormatError(
                f"{where}: field 'sample_offset' is {state['sample_offset']}, past num_prompts={state['num_prompts']}"
            )
        mine = {"num_prompts": len(self.prompts), "n_samples_per_prompt": self.n_samples_per_prompt,
                "shuffle": self.shuffle}
        if self.shuffle:
            mine["seed"] = self.seed  # without shuffling the seed plays no part
        for key, value in mine.items():
            if state[key] != value:
                raise ConfigError(
                    f"{where}: field {key!r} is {state[key]!r} but this data source has {value!r}; the state "
                    "was saved for a different dataset or sampling config, so its cursor does not apply"
                )
        buffer = self._parse_buffer(state["buffer"], where)
        self.epoch_id = state["epoch_id"]
        self.sample_offset = state["sample_offset"]
        self.sample_group_index = state["sample_group_index"]
        self.sample_index = state["sample_index"]
        self.buffer = buffer
        self._order = epoch_order(len(self.prompts), self.shuffle, self.seed, self.epoch_id)

    def _parse_buffer(self, raw: Any, where: str) -> list[list[Sample]]:
        if not isinstance(raw, list):
            raise DataFormatError(f"{where}: field 'buffer' must be a list of groups, got {type(raw).__name__}")
        buffer = []
        for i, group in enumerate(raw):
            if not isinstance(group, list) or len(group) != self.n_samples_per_prompt:
                raise DataFormatError(
                    f"{where}: field 'buffer[{i}]' must be a list of {self.n_samples_per_prompt} samples, "
                    f"got {group!r:.80}"
                )
            try:
                buffer.append([Sample.from_dict(s) for s in group])
            except (DataFormatError, TypeError) as e:  # TypeError: not a dict, or a bad nested field
                raise DataFormatError(f"{where}: field 'buffer[{i}]': {e}") from None
        return buffer

    def save(self, path: str | os.PathLike) -> None:
        """Write `state_dict()` as JSON to a local `path`, atomically: a reader sees the old file or
        the complete new one, never a partial write."""
        path = Path(path)
        try:
            text = json.dumps(self.state_dict())
        except (TypeError, ValueError) as e:  # e.g. a non-JSON value in a buffered sample's metadata
            raise DataFormatError(f"{path}: data source state is not JSON-serialisable: {e}") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, path: str | os.PathLike) -> None:
        """Restore the state written by `save(path)`; a corrupt file raises naming the file."""
        raw = Path(path).read_bytes()
        try:
            state = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataFormatError(f"{path}: not a valid data source state file (JSON): {e}") from None
        self.load_state_dict(state, where=str(path))


def make_data_source(config: Any, tokenizer: Any = None) -> Any:
    """The rollout's data source: `RolloutDataSource` from the config, or the class `data.data_source_path`
    names, built as slime builds it (`cls(args)`)."""
    path = config.data.data_source_path
    if path == DEFAULT_DATA_SOURCE:
        return RolloutDataSource.from_config(config, tokenizer)
    return CustomDataSource(load_function(path)(config.as_namespace()), path)


class CustomDataSource:
    """A data source written to slime's interface, called the way this project's rollout calls one.

    slime's `get_samples(num_samples)` takes no rollout id and its `save`/`load(rollout_id)` write torch
    files next to the checkpoint; here a resume goes through the checkpoint's JSON, so the state is the
    class's own `state_dict()` when it has one (and `load_state_dict` gets it back), else only its length
    is recorded and a resumed run starts the class afresh (logged).
    """

    METHODS = ("get_samples", "add_samples", "__len__")

    def __init__(self, inner: Any, path: str) -> None:
        missing = [m for m in self.METHODS if not callable(getattr(inner, m, None))]
        if missing:
            raise PluginError(f"data_source_path {path}: the data source lacks {missing} (slime's DataSource "
                              "interface: get_samples(num_samples), add_samples(samples), __len__)")
        self.inner, self.path = inner, path

    def __len__(self) -> int:
        return len(self.inner)

    def get_samples(self, num_groups: int, rollout_id: int | None = None) -> list[list[Sample]]:
        groups = self.inner.get_samples(num_groups)
        if not isinstance(groups, list) or not all(isinstance(g, list) and all(isinstance(s, Sample) for s in g)
                                                   for g in groups):
            raise DataFormatError(f"data_source_path {self.path}: get_samples({num_groups}) must return a list of "
                                  f"groups (lists of Sample), got {groups!r:.80}")
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.inner.add_samples(groups)

    def state_dict(self) -> dict[str, Any]:
        own = self.inner.state_dict() if callable(getattr(self.inner, "state_dict", None)) else None
        return {"custom_data_source": self.path, "state": own, "num_prompts": len(self.inner), "buffer": []}

    def load_state_dict(self, state: Any, *, where: str = "data source state") -> None:
        if not isinstance(state, dict) or state.get("custom_data_source") != self.path:
            raise ConfigError(f"{where}: was saved by another data source than {self.path}")
        if state.get("state") is not None and callable(getattr(self.inner, "load_state_dict", None)):
            self.inner.load_state_dict(state["state"])
        else:
            logging.getLogger(__name__).warning("%s: %s keeps no state_dict; it starts afresh on resume", where,
                                                self.path)
