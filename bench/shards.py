"""Shard store throughput: write and read MB/s and samples/s, Arrow IPC vs Parquet-zstd.

Compares the store (Sample -> Arrow conversion, part files, sha256, manifest; on read: checksum,
schema check) with plain pyarrow doing the same job (pa.array per column from the same Python
lists, one local file written, then read back into memory and parsed). Overhead = store time /
plain time - 1. Both read from the page cache after writing, so read figures are memory-bound.

    python bench/shards.py                         # 100k samples x 768 tokens, 3 repeats
    python bench/shards.py --samples 20000 --repeats 5 --json out.json

Figures go to docs/benchmarks.md (command, machine, median of the repeats).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from slime.storage import ShardSet, ShardSetWriter
from slime.storage.schema import SAMPLE_SCHEMA
from slime.types import Sample


def make_samples(n: int, prompt_len: int, response_len: int, seed: int = 0) -> list[Sample]:
    """n samples; token lists come from a pool of 4096 distinct ones (23 MB at 768 tokens: far more
    than a compressor's window, so compression sees no artificial repeats) to keep memory bounded,
    while every element still has to be converted."""
    rng = np.random.default_rng(seed)
    pool = [
        (
            rng.integers(0, 150_000, prompt_len + response_len).tolist(),
            rng.integers(0, 2, response_len).tolist(),
            (-rng.random(response_len)).astype(np.float32).tolist(),
        )
        for _ in range(min(n, 4096))
    ]
    samples = []
    for i in range(n):
        tokens, mask, logp = pool[i % len(pool)]
        samples.append(
            Sample(group_index=i // 8, index=i, prompt="What is 12+34?", tokens=tokens, response="46",
                   response_length=response_len, label="46", reward=float(i % 2), loss_mask=mask,
                   rollout_log_probs=logp, status=Sample.Status.COMPLETED, metadata={"i": i})
        )
    return samples


def plain_table(samples: list[Sample]) -> pa.Table:
    """The same columns built the ordinary pyarrow way, for the baseline."""
    columns = {}
    for field in SAMPLE_SCHEMA:
        name = field.name
        if name in ("prompt", "label", "metadata"):
            values = [json.dumps(getattr(s, name)) for s in samples]
        elif name == "status":
            values = [s.status.value for s in samples]
        elif name in ("spec_info", "prefix_cache_info"):
            values = [vars(getattr(s, name)) for s in samples]
        elif name == "reward_dict":
            values = [None] * len(samples)
        else:
            values = [getattr(s, name) for s in samples]
        columns[name] = pa.array(values, field.type)
    return pa.table(columns, schema=SAMPLE_SCHEMA)


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_once(samples: list[Sample], fmt: str, workdir: Path) -> dict[str, float]:
    compression = "zstd" if fmt == "parquet" else None
    store_uri = str(workdir / f"store-{fmt}")
    plain_path = workdir / f"plain.{fmt}"

    def store_write() -> None:
        with ShardSetWriter(store_uri, format=fmt, compression=compression) as writer:
            writer.write(samples)

    def plain_write() -> None:
        table = plain_table(samples)
        if fmt == "parquet":
            pq.write_table(table, plain_path, compression="zstd")
        else:
            with ipc.new_file(str(plain_path), table.schema) as writer:
                writer.write_table(table)

    def plain_read() -> pa.Table:
        data = pa.py_buffer(plain_path.read_bytes())  # bytes really read, as the store must to verify them
        if fmt == "parquet":
            return pq.read_table(pa.BufferReader(data))
        return ipc.open_file(data).read_all()

    t_store_w, _ = timed(store_write)
    t_plain_w, _ = timed(plain_write)
    nbytes = sum(f.bytes for f in ShardSet.open(store_uri).manifest.files)
    t_store_r, table = timed(lambda: ShardSet.open(store_uri).read_table())
    t_plain_r, _ = timed(plain_read)
    t_samples_r, back = timed(lambda: ShardSet.open(store_uri).read_samples())
    assert table.num_rows == len(back) == len(samples)
    shutil.rmtree(store_uri)
    plain_path.unlink()
    mb = nbytes / 1e6
    return {
        "bytes": nbytes,
        "store_write_MBps": mb / t_store_w,
        "plain_write_MBps": mb / t_plain_w,
        "store_write_samples_per_s": len(samples) / t_store_w,
        "write_overhead": t_store_w / t_plain_w - 1,
        "store_read_MBps": mb / t_store_r,
        "plain_read_MBps": mb / t_plain_r,
        "read_overhead": t_store_r / t_plain_r - 1,
        "store_read_samples_per_s": len(samples) / t_samples_r,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", nargs="+", default=["arrow", "parquet"])
    parser.add_argument("--workdir", help="where files are written (default: a temp dir)")
    parser.add_argument("--json", help="also write the per-repeat figures here")
    args = parser.parse_args()

    samples = make_samples(args.samples, args.prompt_len, args.response_len)
    tokens = args.prompt_len + args.response_len
    print(f"{args.samples} samples x {tokens} tokens, median of {args.repeats} repeats")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="slime-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {}
    try:
        for fmt in args.formats:
            results[fmt] = [run_once(samples, fmt, workdir) for _ in range(args.repeats)]
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    keys = [k for k in next(iter(results.values()))[0] if k != "bytes"]
    print(f"{'metric':28s}" + "".join(f"{fmt:>14s}" for fmt in results))
    print(f"{'size MB':28s}" + "".join(f"{runs[0]['bytes'] / 1e6:14.0f}" for runs in results.values()))
    for key in keys:
        cells = []
        for runs in results.values():
            value = statistics.median(r[key] for r in runs)
            cells.append(f"{value * 100:13.1f}%" if "overhead" in key else f"{value:14.1f}")
        print(f"{key:28s}" + "".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
