"""fsspec access for the artifact store: one place that turns a URL into (filesystem, path)."""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec import AbstractFileSystem


def open_fs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The filesystem serving `uri` and the path inside it (fsspec's own config applies too)."""
    return fsspec.core.url_to_fs(uri, **(storage_options or {}))


def normalize_uri(uri: str) -> str:
    """Local paths become absolute (URIs handed between processes must not depend on the cwd);
    URLs with a protocol are kept as they are, minus a trailing slash."""
    if "://" in uri and not uri.startswith("file://"):
        return uri.rstrip("/")
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    return os.path.abspath(os.path.expanduser(path))


def join_uri(uri: str, *parts: str) -> str:
    """`uri/part/part`, without doubled slashes."""
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def is_local(fs: AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
