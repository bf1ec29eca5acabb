"""When a stage is done: its committed output plus a record of the settings that define it.

Every stage output (`convert/checkpoint`, `sft/checkpoint`, `rejection_sampling`, `rl/checkpoint`,
`export/hf`) gets a record beside it, `<output>.stage.json`: the config values and the input contents that
define the artifact (`StageDefinition`, slime/stages/definitions.py), written with status "started" before the
stage touches its output and again, status "done" with the stage's result, once its artifacts are committed.
Both entry points, `slime <stage>` and the Prefect flows, ask `begin_stage` first, so either one reuses what
the other committed:

* "done" with the same settings and every artifact intact: the stage is finished, its recorded result is
  returned (nothing runs);
* "started" (or done with a broken artifact) with the same settings: a resumable stage (sft, rl) keeps its
  intact checkpoints and continues from the newest, any other starts over with the earlier attempt moved aside;
* other settings, or an output no record describes: refused with `StageSettingsMismatch`, naming every
  differing field, unless `--overwrite` (`run.overwrite`) consents to moving the earlier output aside.

"Moved aside" is renamed to `<name>.replaced-<UTC time>`, never deleted. The settings compare contents, not
spellings: an input is identified by its manifest hash (a checkpoint root by its newest committed iteration) or
the hash of its files, so `runs/x/sft/checkpoint` and `runs/x/sft/checkpoint/iter_0000372` are the same input.
A section's values are the ones set away from their defaults (as `Config.section_hash`), so a later version
that adds a field with a default keeps the record valid. The code version is not part of the settings: an
upgrade reuses finished stages (the Prefect cache key, which holds it, only decides what Prefect replays).
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slime.config import Config
from slime.data.prompts import parse_data_path
from slime.errors import NotCommittedError, StageSettingsMismatch, StorageError
from slime.storage import ArtifactStore, is_committed, manifest_hash, read_manifest
from slime.storage.fs import normalize_uri, open_fs
from slime.storage.manifest import verify_files
from slime.storage.staging import newest_committed

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".stage.json"
RECORD_VERSION = 1
CONTENT_HASH_LIMIT = 64 * 1024**2  # larger uncommitted input files are fingerprinted by size and mtime


@dataclass(frozen=True)
class StageDefinition:
    """What defines a stage's artifact, read off the config the stage runs with.

    `inputs(config)`: role -> input URI (None: not given); their contents are compared. `config_fields`:
    `section` or `section.field` selectors whose values define the artifact; `left_out`: fields of those
    sections not compared (the ones inputs come from, compared by content; ones that do not change the artifact). `output(config)`: the output
    location. `normalize(config)`: the config as the stage reads it (SFT: `train` with its sft_* overrides).
    `resumable`: a same-settings re-run continues from the newest intact checkpoint under the output.
    `required`: fields the stage cannot run without, checked before any record is written. `extendable`:
    fields a resumable stage may raise on the same output, continuing from its newest checkpoint (RL's
    `rollout.num_rollout`: more iterations), every other setting the same.
    """

    name: str
    config_fields: tuple[str, ...]
    inputs: Callable[[Config], dict[str, str | None]]
    output: Callable[[Config], str]
    left_out: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    resumable: bool = False
    extendable: tuple[str, ...] = ()
    normalize: Callable[[Config], Config] | None = None

    def settings(self, config: Config) -> dict[str, Any]:
        """The settings a record holds: config values and input identities."""
        if self.normalize is not None:
            config = self.normalize(config)
        options = config.run.storage_options
        inputs = {role: {"uri": uri, "content": input_identity(uri, options)}
                  for role, uri in sorted(self.inputs(config).items()) if uri}
        return {"config": config_values(config, self.config_fields, self.left_out), "inputs": inputs}


@dataclass
class StageStart:
    """What `begin_stage` decided: `reused` (the recorded result of a finished stage) or a run to do."""

    definition: StageDefinition
    output: str
    record_uri: str
    settings: dict[str, Any]
    storage_options: dict[str, Any] = field(default_factory=dict)
    reused: dict[str, Any] | None = None
    moved: list[str] = field(default_factory=list)

    def finish(self, result: dict[str, Any]) -> None:
        """Record the stage as done with `result` ({"artifacts": {name: {uri, manifest_hash}}, "metrics", ...},
        its artifacts committed already)."""
        kept = {k: v for k, v in result.items() if k in ("stage", "artifacts", "metrics", "seconds")}
        _write_record(self.record_uri, {"status": "done", "stage": self.definition.name, "settings": self.settings,
                                        "result": kept}, self.storage_options)


def config_values(config: Config, selectors: tuple[str, ...], leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """{selector: value}: a whole section as its values set away from the defaults, a single field as it is;
    `leave_out` fields (`section.field`) dropped."""
    values: dict[str, Any] = {}
    for selector in selectors:
        section, _, name = selector.partition(".")
        if name:
            if selector not in leave_out:
                values[selector] = getattr(config, section).model_dump(mode="json", include={name})[name]
            continue
        part = getattr(config, section)
        dump = part.model_dump(mode="json", exclude_defaults=True) if hasattr(part, "model_dump") else dict(part)
        values[selector] = {k: v for k, v in dump.items() if f"{section}.{k}" not in leave_out}
    return values


def artifact_fingerprint(uri: str, storage_options: dict[str, Any] | None = None, missing_ok: bool = False) -> str:
    """Content identity of an input: `manifest:<hash>` when committed, else `files:<hash>` of its files.

    A `path@[a:b]` row slice is stripped here (callers keep the URI beside it). When nothing is at `uri`:
    "missing" if `missing_ok`, else NotCommittedError.
    """
    path, _ = parse_data_path(uri)
    if is_committed(path, storage_options):
        return f"manifest:{manifest_hash(path, storage_options)}"
    fs, root = open_fs(path, storage_options)
    if not fs.exists(root):
        if missing_ok:
            return "missing"
        raise NotCommittedError(f"stage input {uri} does not exist")
    digest = hashlib.sha256()
    for name, info in sorted(fs.find(root, detail=True).items()):
        digest.update(f"{name[len(root):]}\0{info['size']}\0".encode())
        if info["size"] <= CONTENT_HASH_LIMIT:
            digest.update(hashlib.sha256(fs.cat_file(name)).digest())
        else:
            digest.update(str(info.get("mtime", info.get("LastModified", ""))).encode())
    return f"files:{digest.hexdigest()}"


def input_identity(uri: str, storage_options: dict[str, Any] | None = None) -> str:
    """What an input is, whatever its spelling: a checkpoint root is its newest committed iteration; a
    `path@[a:b]` slice keeps its slice."""
    path, _ = parse_data_path(uri)
    identity = artifact_fingerprint(newest_committed(path, storage_options) or path, storage_options, missing_ok=True)
    return identity + uri[len(path):]  # the row slice, if any


def artifact_problems(result: Any, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Why a recorded stage result can no longer be reused ([] when every artifact it names is intact)."""
    if not isinstance(result, dict) or not isinstance(result.get("artifacts"), dict):
        return [f"not a stage result: {type(result).__name__}"]
    problems = []
    for name, artifact in result["artifacts"].items():
        uri = artifact["uri"]
        try:
            current = manifest_hash(uri, storage_options)
        except NotCommittedError:
            problems.append(f"{name} {uri}: manifest missing")
            continue
        if current != artifact["manifest_hash"]:
            problems.append(f"{name} {uri}: manifest changed since the result was recorded")
            continue
        problems += file_problems(uri, storage_options)
    return problems


def file_problems(uri: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Every file of the committed artifact `uri` against its manifest ([] when intact)."""
    try:
        return verify_files(uri, read_manifest(uri, storage_options), storage_options)
    except StorageError as exc:
        return [str(exc)]


def same_settings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal config values and input contents (an input's URI may be spelt otherwise)."""
    def contents(settings: dict[str, Any]) -> dict[str, Any]:
        return {role: value.get("content") for role, value in settings.get("inputs", {}).items()}
    return a.get("config") == b.get("config") and contents(a) == contents(b)


def settings_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per differing setting: `sft.sft_lr: 0.001 -> 0.002`, `input sft_data: other content (...)`."""
    lines: list[str] = []
    old_cfg, new_cfg = old.get("config", {}), new.get("config", {})
    for selector in sorted(set(old_cfg) | set(new_cfg)):
        _diff_value(selector, old_cfg.get(selector, _ABSENT), new_cfg.get(selector, _ABSENT), lines)
    old_in, new_in = old.get("inputs", {}), new.get("inputs", {})
    for role in sorted(set(old_in) | set(new_in)):
        was, now = old_in.get(role), new_in.get(role)
        if was is None or now is None:
            lines.append(f"input {role}: {'none' if was is None else was['uri']} -> {'none' if now is None else now['uri']}")
        elif was["content"] != now["content"]:
            same_uri = was["uri"] == now["uri"]
            lines.append(f"input {role}: other content ({'changed in place: ' + now['uri'] if same_uri else was['uri'] + ' -> ' + now['uri']})")
    return lines


_ABSENT = object()


def _diff_value(path: str, was: Any, now: Any, lines: list[str]) -> None:
    if isinstance(was, dict) and isinstance(now, dict):
        for key in sorted(set(was) | set(now)):
            _diff_value(f"{path}.{key}", was.get(key, _ABSENT), now.get(key, _ABSENT), lines)
    elif was != now:
        lines.append(f"{path}: {_show(was)} -> {_show(now)}")


def _show(value: Any) -> str:
    return "(default)" if value is _ABSENT else json.dumps(value, default=str)


def record_uri(output: str) -> str:
    return output.rstrip("/") + RECORD_SUFFIX


def read_record(output: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The record beside `output` (None when there is none; an unreadable one is reported as such)."""
    fs, path = open_fs(record_uri(output), storage_options)
    if not fs.exists(path):
        return None
    try:
        record = json.loads(fs.cat_file(path))
        if not isinstance(record, dict) or "settings" not in record:
            raise ValueError("no settings in it")
        return record
    except ValueError as exc:
        return {"status": "unreadable", "settings": {}, "error": f"{path}: {exc}"}


def begin_stage(definition: StageDefinition, config: Config, *, overwrite: bool | None = None) -> StageStart:
    """Decide what a run of `definition` with `config` does (module docstring); prepare the output for it."""
    config.require(*definition.required, stage=definition.name)
    options = config.run.storage_options
    output = definition.output(config)
    start = StageStart(definition, output, record_uri(output), definition.settings(config), options)
    consent = config.run.overwrite if overwrite is None else overwrite
    record = read_record(output, options)
    fs, path = open_fs(output, options)
    exists = fs.exists(path)
    if record is not None and same_settings(record["settings"], start.settings):
        if record.get("status") == "done":
            problems = artifact_problems(record.get("result"), options)
            if not problems:
                logger.info("%s: %s is done with these settings (%s): reusing it", definition.name, output,
                            start.record_uri)
                start.reused = record["result"]
                return start
            logger.warning("%s: the recorded output is no longer intact (%s); the stage runs again",
                           definition.name, "; ".join(problems[:3]))
        if exists:
            start.moved = (_keep_intact_checkpoints(fs, path, options) if definition.resumable
                           else [move_aside(fs, path)])
    elif record is not None and (grown := _extended(definition, record["settings"], start.settings)):
        logger.info("%s: %s continues with %s", definition.name, output, ", ".join(grown))
        if exists:
            start.moved = _keep_intact_checkpoints(fs, path, options)
    elif record is not None and (renewed := _renewed_upstream(record["settings"], start.settings, config)):
        # only inputs that earlier stages of this run committed anew (a re-run SFT): this output is stale by the
        # run's own doing, not by other settings for this stage
        logger.warning("%s: %s committed anew upstream since %s was made: running %s again", definition.name,
                       ", ".join(renewed), output, definition.name)
        start.moved = [move_aside(fs, path)] if exists else []
    elif record is not None and record.get("status") == "started" and not _holds_committed(fs, path, options):
        # an attempt with other settings that committed nothing (it failed early): nothing to reuse or lose
        logger.warning("%s: an unfinished attempt with other settings left nothing committed at %s: starting "
                       "over", definition.name, output)
        start.moved = [move_aside(fs, path)] if exists else []
    elif record is not None or exists:
        if not consent:
            raise StageSettingsMismatch(_refusal(definition.name, output, record, start.settings, config))
        start.moved = [move_aside(fs, path)] if exists else []
        if record is not None:
            rfs, rpath = open_fs(start.record_uri, options)
            start.moved.append(move_aside(rfs, rpath))
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    _write_record(start.record_uri, {"status": "started", "stage": definition.name, "settings": start.settings},
                  options)
    return start


def _extended(definition: StageDefinition, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`field: old -> new` for each extendable field raised, when those are the only differences; [] else."""
    if not definition.resumable or not definition.extendable:
        return []
    grown = []
    old_cfg, new_cfg = copy.deepcopy(old.get("config", {})), copy.deepcopy(new.get("config", {}))
    for dotted in definition.extendable:
        section, _, name = dotted.partition(".")
        was, now = old_cfg.get(section, {}).pop(name, None), new_cfg.get(section, {}).pop(name, None)
        if was == now:
            continue
        if not isinstance(was, int | float) or not isinstance(now, int | float) or now < was:
            return []
        grown.append(f"{dotted} {was} -> {now}")
    if not grown or not same_settings({**old, "config": old_cfg}, {**new, "config": new_cfg}):
        return []
    return grown


def _renewed_upstream(old: dict[str, Any], new: dict[str, Any], config: Config) -> list[str]:
    """The differing inputs when the config values are equal and every differing input is a committed artifact
    inside this run's directory (an upstream stage of the run made it again); [] otherwise."""
    if old.get("config") != new.get("config") or config.run.run_id is None:
        return []
    run_dir = normalize_uri(ArtifactStore.from_config(config).uri(config.run.run_id)) + "/"
    was, now = old.get("inputs", {}), new.get("inputs", {})
    differing = [role for role in sorted(set(was) | set(now))
                 if (was.get(role) or {}).get("content") != (now.get(role) or {}).get("content")]
    for role in differing:
        value = now.get(role)
        if (value is None or role not in was or not value["content"].startswith("manifest:")
                or not normalize_uri(value["uri"]).startswith(run_dir)
                or _location(was[role]["uri"]) != _location(value["uri"])):
            return []
    return [f"input {role} ({now[role]['uri']})" for role in differing]


def _location(uri: str) -> str:
    """Where an input lives: a checkpoint iteration stands for its save root (a re-run may end at another
    iteration of the same root)."""
    path = normalize_uri(parse_data_path(uri)[0])
    head, _, tail = path.rstrip("/").rpartition("/")
    return head if re.fullmatch(r"iter_\d{7}", tail) else path


def _refusal(stage: str, output: str, record: dict[str, Any] | None, settings: dict[str, Any],
             config: Config) -> str:
    run = config.run.run_id
    ways = (f"run it as a new run (--run-id {run}-2, or any unused id), or pass --overwrite to move the earlier "
            f"output aside (renamed {output.rstrip('/').rsplit('/', 1)[-1]}.replaced-<time>, never deleted) and "
            f"run {stage} again")
    if record is None:
        return (f"{stage}: {output} holds an output with no record of the settings that made it ({RECORD_SUFFIX} "
                f"missing: written by another tool or an older version of this project), so it cannot be reused "
                f"safely; {ways}")
    if record.get("status") == "unreadable":
        return f"{stage}: {record['error']}: the record of {output} is unreadable; {ways}"
    diff = settings_diff(record["settings"], settings)
    state = "a finished" if record.get("status") == "done" else "an unfinished"
    shown = "\n  ".join(diff[:20]) + (f"\n  ... and {len(diff) - 20} more" if len(diff) > 20 else "")
    return (f"{stage}: {output} holds {state} {stage} of run {run!r} with other settings than this one:\n  {shown}\n"
            f"Its artifact would not be what this config asks for; {ways}")


def _holds_committed(fs: Any, path: str, options: dict[str, Any]) -> bool:
    """Whether `path` is, or directly holds, a committed artifact (a checkpoint iteration, a shard set)."""
    if not fs.exists(path):
        return False
    if is_committed(path, options):
        return True
    return fs.isdir(path) and any(is_committed(child, options) for child in fs.ls(path, detail=False))


def _keep_intact_checkpoints(fs: Any, path: str, options: dict[str, Any]) -> list[str]:
    """A resumable attempt's checkpoints, newest first down to the first intact one: corrupt ones moved aside."""
    moved = []
    for child in sorted(fs.ls(path, detail=False), reverse=True):
        if not is_committed(child, options):
            continue  # uncommitted leftovers are invisible to readers and overwritten by writers
        if not file_problems(child, options):
            break
        moved.append(move_aside(fs, child))
    return moved


def move_aside(fs: Any, path: str) -> str:
    """Rename `path` to `<path>.replaced-<UTC time>` (nothing is deleted); the new path."""
    aside = f"{path.rstrip('/')}.replaced-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%S%fZ')}"
    fs.mv(path, aside, recursive=True)
    logger.warning("moved %s aside to %s", path, aside)
    return aside


def _write_record(uri: str, record: dict[str, Any], storage_options: dict[str, Any] | None) -> None:
    """Write the record whole or not at all: a temporary file renamed over it (one put on object stores)."""
    fs, path = open_fs(uri, storage_options)
    blob = json.dumps({"version": RECORD_VERSION, **record}, indent=1, sort_keys=True, default=str).encode()
    tmp = f"{path}.tmp"
    fs.pipe_file(tmp, blob)
    fs.mv(tmp, path)
