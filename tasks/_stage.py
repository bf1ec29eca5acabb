"""What every stage task does around its one slime call: point the config at the run's locations,
clear the output location, time the phases and describe the result as JSON."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Iterator
from typing import Any

from slime.config import Config
from slime.storage.fs import open_fs

logger = logging.getLogger(__name__)


def with_fields(config: Config, **dotted: Any) -> Config:
    """A validated copy of `config` with `section__field=value` fields replaced (the original is untouched)."""
    data = config.model_dump(mode="json")
    for key, value in dotted.items():
        section, field = key.split("__")
        data[section][field] = value
    return Config.model_validate(data)


def clear_output(uri: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """Move whatever is at a stage's output location aside before the stage writes there.

    A stage only runs when no intact cached result exists, so anything here is a failed attempt's
    half-written files, a stale or corrupt artifact, or the output of other inputs. It is renamed to
    `<uri>.replaced-<UTC time>` rather than deleted (nothing is lost); returns that name, or None.
    """
    fs, path = open_fs(uri, storage_options)
    if not fs.exists(path):
        return None
    aside = f"{path}.replaced-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%S%fZ')}"
    fs.mv(path, aside, recursive=True)
    logger.warning("moved the previous contents of %s aside to %s", uri, aside)
    return aside


class Phases:
    """Wall time per named phase, for the stage report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - start, 3)


def stage_result(stage: str, artifacts: dict[str, tuple[str, str]], metrics: dict[str, Any],
                 phases: Phases, **extra: Any) -> dict[str, Any]:
    """The JSON result a stage task returns and Prefect persists: artifact URIs with manifest hashes,
    small metrics and phase times. `artifacts` maps a name to (uri, manifest hash)."""
    return {"stage": stage,
            "artifacts": {name: {"uri": uri, "manifest_hash": digest} for name, (uri, digest) in artifacts.items()},
            "metrics": metrics, "seconds": phases.seconds, **extra}
