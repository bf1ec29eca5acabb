"""What the distributed delta sync adds per sync on trainer rank 0 (slime/sync/distributed_delta.py):
the device-side fingerprint of every tensor, and the configured checksum (host copy + hash) of the tensors
that are sent; against the bytes themselves.

    python bench/delta_cost.py --device cuda --dtype bf16 --mb 1024      # one GPU
    python bench/delta_cost.py --device cpu --dtype fp32 --mb 64

Prints one JSON line: seconds (median of --repeats after one warm-up) and GB/s for each step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from slime.delta_codec import checksum, host_bytes
from slime.sync.distributed_delta import fingerprint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--mb", type=int, default=1024, help="size of the one tensor measured, MB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    numel = args.mb * 10**6 // torch.tensor([], dtype=dtype).element_size()
    tensor = torch.randn(numel, device=device).to(dtype)
    nbytes = numel * tensor.element_size()
    row = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": args.dtype,
           "bytes": nbytes}
    row["fingerprint_s"] = timed(lambda: fingerprint(tensor).tolist(), device, args.repeats)
    row["host_copy_s"] = timed(lambda: host_bytes(tensor), device, args.repeats)
    host = host_bytes(tensor)
    for algorithm in ("xxh3-128", "blake3", "adler32"):
        row[f"{algorithm}_s"] = timed(lambda a=algorithm: checksum(host, a), torch.device("cpu"), args.repeats)
    for key in [k for k in row if k.endswith("_s")]:
        row[key.removesuffix("_s") + "_gb_per_s"] = round(nbytes / 1e9 / row[key], 2)
        row[key] = round(row[key], 5)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
