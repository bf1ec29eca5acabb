"""Repack a wheel smaller for the GPU machine's 64 MiB transfers: drop members by glob, strip ELF symbols.

    python bench/gpu_env/repack_wheel.py WHEEL OUT_DIR [--drop GLOB ...] [--strip]

The RECORD is rewritten with every kept member's sha256 and size, so pip installs the result as it would
the original. Stripping (`strip --strip-unneeded`) keeps the dynamic symbols that loading needs and drops
the symbol tables (ray's raylet and GCS server, sglang-router's Rust library): only native stack traces lose
their function names.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import subprocess
import tempfile
import zipfile
from pathlib import Path


def _strip(data: bytes) -> bytes:
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        subprocess.run(["strip", "--strip-unneeded", f.name], check=True)
        return Path(f.name).read_bytes()


def repack(src: Path, out_dir: Path, drop: list[str], strip: bool) -> Path:
    dst = out_dir / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in zin.infolist():
            name = info.filename
            if name == record or any(fnmatch.fnmatch(name, g) for g in drop):
                continue
            data = zin.read(name)
            if strip and data[:4] == b"\x7fELF":
                data = _strip(data)
            out = zipfile.ZipInfo(name, info.date_time)
            out.external_attr, out.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            zout.writestr(out, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{name},sha256={digest},{len(data)}")
        rows.append(f"{record},,")
        zout.writestr(record, "\n".join(rows) + "\n")
    print(f"{src.name}: {src.stat().st_size / 1e6:.1f} MB -> {dst.stat().st_size / 1e6:.1f} MB")
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--drop", action="append", default=[], help="glob of members to leave out (repeatable)")
    p.add_argument("--strip", action="store_true", help="strip the symbol tables of ELF members")
    a = p.parse_args()
    repack(a.wheel, a.out_dir, a.drop, a.strip)


if __name__ == "__main__":
    main()
