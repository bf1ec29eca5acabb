"""The Arrow schema of rollout and SFT shards, and `Sample` <-> Arrow conversion.

Every `Sample` field has a column, so a shard round trip loses nothing. Token-level lists use
compact types (tokens list<int32>, loss mask list<uint8>, log-probs list<float32>); free-form
values (prompt, label, metadata, dict rewards) are JSON strings. List columns are built from one
flat numpy buffer plus offsets instead of per-row Arrow objects (measured: ~40 ns per element, the
cost of touching each Python int once).

Precision note: log-probs are stored as float32; a value that is not float32-representable is
rounded to the nearest float32 (engines compute them in fp32 or lower, so nothing is lost there).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from slime.errors import DataFormatError, SchemaVersionError
from slime.types import PrefixCacheInfo, Sample, SpecInfo, Status

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: before token_weight_versions (read with that column null)
VERSION_KEY = b"slime.schema_version"
KIND_KEY = b"slime.kind"

_SPEC_INFO = pa.struct([(name, pa.int64()) for name in SpecInfo.__dataclass_fields__])
_PREFIX_CACHE_INFO = pa.struct([(name, pa.int64()) for name in PrefixCacheInfo.__dataclass_fields__])

SAMPLE_SCHEMA = pa.schema(
    [
        ("group_index", pa.int64()),
        ("index", pa.int64()),
        ("prompt", pa.string()),  # JSON: a string or a list of chat messages
        ("tokens", pa.list_(pa.int32())),  # prompt + response token ids
        ("response", pa.string()),
        ("response_length", pa.int32()),
        ("label", pa.string()),  # JSON, null when absent
        ("reward", pa.float64()),  # scalar reward, null when unset or a dict
        ("reward_dict", pa.string()),  # JSON of a dict reward, else null
        ("loss_mask", pa.list_(pa.uint8())),
        ("rollout_log_probs", pa.list_(pa.float32())),
        ("teacher_log_probs", pa.list_(pa.float32())),
        ("rollout_routed_experts", pa.list_(pa.list_(pa.int32()))),
        ("weight_versions", pa.list_(pa.string())),
        ("token_weight_versions", pa.list_(pa.int32())),  # per response token; null in version-1 files
        ("status", pa.string()),
        ("remove_sample", pa.bool_()),
        ("metadata", pa.string()),  # JSON object
        ("train_metadata", pa.string()),  # JSON object or null
        ("generate_function_path", pa.string()),
        ("session_id", pa.string()),
        ("non_generation_time", pa.float64()),
        ("spec_info", _SPEC_INFO),
        ("prefix_cache_info", _PREFIX_CACHE_INFO),
    ],
    metadata={VERSION_KEY: str(SCHEMA_VERSION).encode(), KIND_KEY: b"samples"},
)

_V1_SCHEMA = pa.schema([f for f in SAMPLE_SCHEMA if f.name != "token_weight_versions"],
                       metadata={VERSION_KEY: b"1", KIND_KEY: b"samples"})

_NUMERIC_LISTS = {
    "tokens": np.int32,
    "loss_mask": np.uint8,
    "rollout_log_probs": np.float32,
    "teacher_log_probs": np.float32,
    "token_weight_versions": np.int32,
}


def _list_column(rows: Sequence[Any], value_type: pa.DataType, dtype: type) -> pa.Array:
    """list<value_type> from per-row sequences (lists or numpy arrays); None rows become nulls."""
    n = len(rows)
    lengths = np.fromiter((0 if r is None else len(r) for r in rows), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [r for r in rows if r is not None]
    if offsets[-1] > np.iinfo(np.int32).max:
        raise DataFormatError(f"{offsets[-1]} list elements in one batch exceed Arrow's 2**31 limit: write fewer rows")
    if present and isinstance(present[0], np.ndarray):
        values = np.concatenate([np.asarray(r, dtype=dtype) for r in present])
    else:
        values = np.fromiter(itertools.chain.from_iterable(present), dtype=dtype, count=int(offsets[-1]))
    mask = pa.array([r is None for r in rows]) if len(present) != n else None
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=value_type), mask=mask)


def _json_or_none(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def samples_to_batch(samples: Sequence[Sample]) -> pa.RecordBatch:
    """Convert samples to one RecordBatch of `SAMPLE_SCHEMA` (checks each sample's length invariants)."""
    for sample in samples:
        sample.validate()
    columns: dict[str, pa.Array] = {}
    for name, dtype in _NUMERIC_LISTS.items():
        columns[name] = _list_column([getattr(s, name) for s in samples], SAMPLE_SCHEMA.field(name).type.value_type,
                                     dtype)
    scalar_rewards, dict_rewards = [], []
    for s in samples:
        is_dict = isinstance(s.reward, dict)
        scalar_rewards.append(None if is_dict or s.reward is None else float(s.reward))
        dict_rewards.append(json.dumps(s.reward, ensure_ascii=False) if is_dict else None)
    columns.update(
        group_index=pa.array([s.group_index for s in samples], pa.int64()),
        index=pa.array([s.index for s in samples], pa.int64()),
        prompt=pa.array([json.dumps(s.prompt, ensure_ascii=False) for s in samples], pa.string()),
        response=pa.array([s.response for s in samples], pa.string()),
        response_length=pa.array([s.response_length for s in samples], pa.int32()),
        label=pa.array([_json_or_none(s.label) for s in samples], pa.string()),
        reward=pa.array(scalar_rewards, pa.float64()),
        reward_dict=pa.array(dict_rewards, pa.string()),
        rollout_routed_experts=pa.array([s.rollout_routed_experts for s in samples],
                                        SAMPLE_SCHEMA.field("rollout_routed_experts").type),
        weight_versions=pa.array([s.weight_versions for s in samples], pa.list_(pa.string())),
        status=pa.array([s.status.value for s in samples], pa.string()),
        remove_sample=pa.array([s.remove_sample for s in samples], pa.bool_()),
        metadata=pa.array([json.dumps(s.metadata, ensure_ascii=False) for s in samples], pa.string()),
        train_metadata=pa.array([_json_or_none(s.train_metadata) for s in samples], pa.string()),
        generate_function_path=pa.array([s.generate_function_path for s in samples], pa.string()),
        session_id=pa.array([s.session_id for s in samples], pa.string()),
        non_generation_time=pa.array([s.non_generation_time for s in samples], pa.float64()),
        spec_info=pa.array([vars(s.spec_info) for s in samples], _SPEC_INFO),
        prefix_cache_info=pa.array([vars(s.prefix_cache_info) for s in samples], _PREFIX_CACHE_INFO),
    )
    return pa.RecordBatch.from_arrays([columns[f.name] for f in SAMPLE_SCHEMA], schema=SAMPLE_SCHEMA)


def check_schema(schema: pa.Schema, where: str, *, current_only: bool = False) -> None:
    """Refuse data written with another schema version or layout, naming the file; `current_only`
    (writers) refuses the older readable versions too."""
    meta = schema.metadata or {}
    version = meta.get(VERSION_KEY)
    if version is None:
        raise SchemaVersionError(f"{where}: no {VERSION_KEY.decode()} in the file metadata: not a slime shard")
    if int(version) not in READABLE_VERSIONS or (current_only and int(version) != SCHEMA_VERSION):
        raise SchemaVersionError(
            f"{where}: schema version {int(version)}, this code reads versions "
            f"{[SCHEMA_VERSION] if current_only else list(READABLE_VERSIONS)}"
        )
    expected = SAMPLE_SCHEMA if int(version) == SCHEMA_VERSION else _V1_SCHEMA
    if not schema.remove_metadata().equals(expected.remove_metadata()):
        raise SchemaVersionError(f"{where}: columns differ from schema version {int(version)}: {schema.names}")


def upgrade_table(table: pa.Table) -> pa.Table:
    """A table of any readable version (checked by `check_schema`) as the current schema: a version-1
    table gets a null `token_weight_versions` column (those shards never recorded it)."""
    if table.schema.equals(SAMPLE_SCHEMA, check_metadata=False):
        return table.replace_schema_metadata(SAMPLE_SCHEMA.metadata)
    index = SAMPLE_SCHEMA.get_field_index("token_weight_versions")
    field = SAMPLE_SCHEMA.field(index)
    table = table.add_column(index, field, pa.nulls(table.num_rows, field.type))
    return table.replace_schema_metadata(SAMPLE_SCHEMA.metadata)


def _split(column: pa.ChunkedArray | pa.Array) -> list[list | None]:
    """Per-row Python lists of a numeric list column, through one flat numpy buffer."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(array) == 0:
        return []
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False).tolist()
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(array))]


def table_to_samples(table: pa.Table | pa.RecordBatch) -> list[Sample]:
    """Inverse of `samples_to_batch`."""
    lists = {name: _split(table.column(name)) for name in _NUMERIC_LISTS}
    cols = {
        name: table.column(name).to_pylist()
        for name in SAMPLE_SCHEMA.names
        if name not in _NUMERIC_LISTS
    }
    samples = []
    for i in range(table.num_rows):
        reward_dict = cols["reward_dict"][i]
        try:
            status = Status(cols["status"][i])
        except ValueError:
            raise DataFormatError(f"row {i}: unknown status {cols['status'][i]!r}") from None
        samples.append(
            Sample(
                group_index=cols["group_index"][i],
                index=cols["index"][i],
                prompt=json.loads(cols["prompt"][i]),
                tokens=lists["tokens"][i],
                response=cols["response"][i],
                response_length=cols["response_length"][i],
                label=None if cols["label"][i] is None else json.loads(cols["label"][i]),
                reward=json.loads(reward_dict) if reward_dict is not None else cols["reward"][i],
                loss_mask=lists["loss_mask"][i],
                weight_versions=cols["weight_versions"][i],
                token_weight_versions=lists["token_weight_versions"][i],
                rollout_log_probs=lists["rollout_log_probs"][i],
                rollout_routed_experts=cols["rollout_routed_experts"][i],
                remove_sample=cols["remove_sample"][i],
                teacher_log_probs=lists["teacher_log_probs"][i],
                status=status,
                metadata=json.loads(cols["metadata"][i]),
                generate_function_path=cols["generate_function_path"][i],
                train_metadata=None if cols["train_metadata"][i] is None else json.loads(cols["train_metadata"][i]),
                session_id=cols["session_id"][i],
                non_generation_time=cols["non_generation_time"][i],
                spec_info=SpecInfo(**cols["spec_info"][i]),
                prefix_cache_info=PrefixCacheInfo(**cols["prefix_cache_info"][i]),
            )
        )
    return samples
