"""Read what a W&B offline run wrote (its `run-<id>.wandb` file), to check W&B logging without a server.

The file is wandb's transaction log: a 7-byte header (`:W&B`, version), then LevelDB-log-format records in
32 KiB blocks (4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last), each a
`wandb_internal_pb2.Record` protobuf.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

HEADER, BLOCK, RECORD_HEADER = 7, 32768, 7


def _records(path: Path) -> list[bytes]:
    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending, out = HEADER, b"", []
    while pos + RECORD_HEADER <= len(raw):
        if BLOCK - pos % BLOCK < RECORD_HEADER:  # block trailer too short for a record: padding
            pos += BLOCK - pos % BLOCK
            continue
        _checksum, length, kind = struct.unpack("<IHB", raw[pos:pos + RECORD_HEADER])
        pos += RECORD_HEADER
        data, pos = raw[pos:pos + length], pos + length
        if kind == 0 and length == 0:
            break
        if kind == 1:
            out.append(data)
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            out.append(pending + data)
    return out


def read_offline_run(wandb_dir: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """The single offline run under `wandb_dir`/wandb: its run record fields, config and history rows.

    `wandb.finish()` can return before wandb's service process has written the log out (seen in CI: a file
    with no run record yet, read right after `finish`), so the file is read again until it holds the run's
    exit record, for at most `timeout_s`."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    [path] = list(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        for data in _records(path):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(data)
            except DecodeError:  # the last record half written: read the file again
                break
            records.append(record)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds:
            break
        assert time.monotonic() < deadline, f"{path}: no exit record {timeout_s:.0f} s after finish (records: {kinds})"
        time.sleep(0.1)
    run: dict[str, Any] = {"path": path, "history": [], "config": {}}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, project=record.run.project, group=record.run.run_group,
                       name=record.run.display_name)
            run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.history.item})
    return run
