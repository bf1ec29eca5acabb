"""Byte-level tensor deltas and checksums of slime's delta weight sync (`--update-weight-mode delta`).

Shared by the trainer side, which encodes and checksums what changed (`slime/sync/delta.py`,
`distributed_delta.py`), and the engine that checks what it receives (`slime/engines/builtin/weights.py`).
Encodings are slime's, byte-level and dtype-blind: `xor` (new ^ old; apply exactly once, to the right base)
and `overwrite` (positions and new values of the changed bytes; re-applicable).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

CHECKSUM_ALGORITHMS = ("xxh3-128", "blake3", "adler32")  # --update-weight-delta-checksum


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a flat uint8 array: a view when it is a contiguous CPU tensor (no copy),
    else one copy to the host."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a flat uint8 array of its own (never a view of the tensor)."""
    return host_bytes(tensor).copy()


def checksum(data: np.ndarray | bytes, algorithm: str) -> str:
    """Hex digest of `data` with slime's choices: xxh3-128 (fast), blake3 (cryptographic), adler32."""
    buf = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else data
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128_hexdigest(buf)
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(buf).hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(buf):08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def encode(old: np.ndarray, new: np.ndarray, encoding: str) -> bytes:
    """The uncompressed delta taking `old` to `new` (same byte length)."""
    if encoding == "xor":
        return np.bitwise_xor(old, new).tobytes()
    if encoding == "overwrite":
        positions = np.flatnonzero(old != new).astype(np.int64)
        return positions.tobytes() + new[positions].tobytes()
    raise ValueError(f"unknown delta encoding {encoding!r}")


def decode(old: np.ndarray, delta: bytes, encoding: str) -> np.ndarray:
    """`old` with `delta` applied (a new array)."""
    if encoding == "xor":
        return np.bitwise_xor(old, np.frombuffer(delta, dtype=np.uint8))
    if encoding == "overwrite":
        count = len(delta) // 9  # 8 bytes of position + 1 byte of value per changed byte
        positions = np.frombuffer(delta[: 8 * count], dtype=np.int64)
        out = old.copy()
        out[positions] = np.frombuffer(delta[8 * count:], dtype=np.uint8)
        return out
    raise ValueError(f"unknown delta encoding {encoding!r}")
