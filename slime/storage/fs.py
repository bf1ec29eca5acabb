"""fsspec access for the artifact store: one place that turns a URL into (filesystem, path)."""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from slime.errors import ConfigError


def open_fs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The filesystem serving `uri` and the path inside it (fsspec's own config applies too); a protocol
    fsspec does not know, or whose package is not installed, is a ConfigError naming the URL."""
    if (protocol := unknown_protocol(uri)) is not None:
        raise ConfigError(f"{uri}: unknown storage protocol {protocol!r}: use a local path or an fsspec URL "
                          "(s3://bucket/prefix, gs://..., memory://...)")
    try:
        return fsspec.core.url_to_fs(uri, **(storage_options or {}))
    except ImportError as exc:  # a known protocol without its package: "Install s3fs to access S3"
        raise ConfigError(f"{uri}: {exc}") from None


def unknown_protocol(uri: str) -> str | None:
    """The first protocol of `uri` (`s3://...`, chained `simplecache::s3://...`) fsspec does not know."""
    if "://" not in uri:
        return None
    known = set(fsspec.available_protocols())
    return next((p for p in uri.split("://", 1)[0].split("::") if p not in known), None)


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


def is_hf_dir(path: str) -> bool:
    """True for a local HF model directory (it has a config.json): what engines serve and conversion reads, as
    against a Megatron checkpoint or a `--save` root."""
    return os.path.isfile(os.path.join(path, "config.json"))
