"""Per-step RL metrics: the headline numbers of a step, a JSON-lines log in the store, TensorBoard.

Every rollout step becomes one JSON object (one line of `{store}/{run_id}/rl/metrics.jsonl`) holding
the headline keys below plus every scalar the rollout manager, the train group, the weight sync and
the eval returned. The file is only ever appended to (one write per line), so a resumed run adds
its lines after the killed run's; a step that ran twice (after the last checkpoint, before a kill)
appears twice and the later line is the one that counts (`read_metrics` keeps it). An eval that ran
in the background (fully async with an eval fleet, slime.rl.eval_fleet) adds a line of its own when it
ends, `"record": "eval"` with its step's rollout id, after that step's line: `read_metrics` merges it into
the step's record.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

from slime.errors import ConfigError
from slime.storage.fs import is_local, open_fs

logger = logging.getLogger(__name__)

# headline key -> where it comes from (the first source present wins)
HEADLINE: dict[str, tuple[str, ...]] = {
    "rl/rollout_s": ("rollout/time_s", "perf/rollout_time"),
    "rl/train_s": ("perf/train_time",),
    "rl/sync_s": ("sync/total_s",),
    "rl/tokens_per_s": ("rollout/tokens_per_s",),
    "rl/reward_mean": ("rollout/raw_reward", "rollout/reward/mean"),
    "rl/ppo_kl": ("train/ppo_kl",),
    "rl/ref_kl": ("rollout/kl",),
    "rl/entropy": ("train/entropy_loss",),
    "rl/clip_frac": ("train/pg_clipfrac",),
    "rl/grad_norm": ("train/grad_norm",),
    "rl/logprob_abs_diff": ("train/train_rollout_logprob_abs_diff",),
}


def headline(metrics: dict[str, Any]) -> dict[str, float]:
    """The headline numbers of one step's merged metrics (missing sources are left out)."""
    out: dict[str, float] = {}
    for key, sources in HEADLINE.items():
        for source in sources:
            value = metrics.get(source)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = float(value)
                break
    return out


def jsonable(metrics: dict[str, Any]) -> dict[str, Any]:
    """Scalars only, NaN/inf as None (strict JSON readers refuse NaN)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
        elif isinstance(value, int | float | str | bool) or value is None:
            out[key] = value
    return out


# keys of a step record that measure time or speed, or name outputs of the run: they differ between two
# runs of the same config and seed, everything else must not
_RUN_SPECIFIC = re.compile(r"(_s$|_time$|time_s$|per_s$|^time$|^perf/|^sync/|uri$|checkpoint$)")


# gaps between the trainer's and the engine's log-probs: the engine computes a request's log-probs in
# whatever batch it shares with others, and fp32 rounding depends on the batch (~1e-7 on CPU)
ENGINE_ROUNDED = ("rl/logprob_abs_diff", "train/train_rollout_logprob_abs_diff")
ENGINE_ROUNDED_ATOL = 1e-6


def outcome(record: dict[str, Any]) -> dict[str, Any]:
    """A step record without its timings, sync figures and output URIs: what an interrupted-and-resumed
    run must reproduce (rewards, losses, KL, grad norm, eval results, token counts)."""
    return {k: v for k, v in record.items() if not _RUN_SPECIFIC.search(k)}


def outcome_differences(record: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """How the outcomes of two step records differ, one line per key ([] when they agree): equal values,
    except `ENGINE_ROUNDED` keys, within `ENGINE_ROUNDED_ATOL` (the trained weights do not depend on them)."""
    mine, theirs = outcome(record), outcome(reference)
    problems = []
    for key in sorted(mine.keys() | theirs.keys()):
        a, b = mine.get(key), theirs.get(key)
        if key in ENGINE_ROUNDED and isinstance(a, float) and isinstance(b, float):
            if abs(a - b) > ENGINE_ROUNDED_ATOL:
                problems.append(f"{key}: {a!r} != {b!r} (beyond {ENGINE_ROUNDED_ATOL})")
        elif a != b or key not in mine or key not in theirs:
            problems.append(f"{key}: {a!r} != {b!r}")
    return problems


def check_tensorboard(enabled: bool) -> None:
    """Fail before anything starts when TensorBoard logging is asked for but cannot work."""
    if not enabled:
        return
    try:
        import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
    except ImportError:
        raise ConfigError("run.use_tensorboard (--use-tensorboard) is set but the 'tensorboard' package is not "
                          "installed: pip install tensorboard, or turn use_tensorboard off") from None


class MetricsLog:
    """Appends step records to `uri` (any fsspec URL) and mirrors scalars to TensorBoard and W&B
    (`slime.rl.tracking.WandbLogger`) when asked."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None,
                 tensorboard_dir: str | None = None, wandb: Any = None) -> None:
        self.wandb = wandb
        self.uri = uri
        self.storage_options = storage_options or {}
        self.fs, self.path = open_fs(uri, self.storage_options)
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        self.writer: Any = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir)

    def append(self, record: dict[str, Any]) -> None:
        """One line per call; on a local store a single `write` in append mode (O_APPEND), elsewhere
        read-modify-write (object stores have no append)."""
        line = (json.dumps(jsonable(record), sort_keys=True) + "\n").encode()
        if is_local(self.fs):
            with open(self.path, "ab") as f:
                f.write(line)
        else:
            before = self.fs.cat_file(self.path) if self.fs.exists(self.path) else b""
            self.fs.pipe_file(self.path, before + line)
        if self.writer is not None:
            step = int(record["rollout_id"])
            for key, value in record.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and key != "rollout_id":
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(record)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read_metrics(uri: str, storage_options: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """rollout id -> its record; a step written twice (re-run after a resume) keeps the later line; an eval
    line (`"record": "eval"`) is merged into the record of its rollout id written before it."""
    fs, path = open_fs(uri, storage_options or {})
    if not fs.exists(path):
        return {}
    records: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(fs.cat_file(path).decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by a crash mid-write
            logger.warning("%s:%d: not JSON, skipped", uri, number)
            continue
        rollout_id = int(record["rollout_id"])
        if record.get("record") == "eval":
            if rollout_id in records:
                records[rollout_id].update({k: v for k, v in record.items() if k not in ("record", "time")})
            else:
                logger.warning("%s:%d: eval line of rollout %d before that step's line, skipped", uri, number,
                               rollout_id)
            continue
        records[rollout_id] = record
    return records
