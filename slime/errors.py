"""Exception types raised by the library.

Every error a user can cause (bad config, bad data, a missing or corrupt artifact) has its own type
so callers can react to it, and its message names the file, line or field that is wrong.
"""


class SlimeError(Exception):
    """Base class of every error raised on purpose by slime."""


class ConfigError(SlimeError, ValueError):
    """The configuration (YAML file or CLI override) is invalid."""


class StageSettingsMismatch(ConfigError):
    """A stage's output was made with other settings (config values, input contents) than the run asks for;
    the message names each differing field and the ways out (a new run id, or --overwrite)."""


class DataFormatError(SlimeError, ValueError):
    """A data file (prompt JSONL/Parquet, sample dict) is malformed or lacks a required field."""


class StorageError(SlimeError):
    """Base class of artifact-store errors."""


class NotCommittedError(StorageError, FileNotFoundError):
    """An artifact was asked for that has no committed manifest (missing or half-written)."""


class AlreadyCommittedError(StorageError, FileExistsError):
    """A writer tried to commit to a location that another writer has already committed."""


class CorruptArtifactError(StorageError):
    """A committed artifact does not match its manifest (checksum, size, row count, schema)."""


class StorageWriteError(StorageError, OSError):
    """Writing an artifact's file failed (disk full, permission, network); nothing was committed."""


class SchemaVersionError(StorageError):
    """A shard was written with a schema version this code cannot read."""


class EngineError(SlimeError):
    """Base class of inference-engine and router errors (launch, HTTP, worker registration)."""


class EngineStartError(EngineError, RuntimeError):
    """An engine or router process exited or did not become healthy in time; the message has its log tail."""


class EngineHTTPError(EngineError):
    """An HTTP request to an engine or the router failed for good (after any retries).

    `status` and `body` are None when no response came back (connection refused, timeout).
    """

    def __init__(self, message: str, *, method: str = "", url: str = "", status: int | None = None,
                 body: str | None = None) -> None:
        super().__init__(message)
        self.method = method
        self.url = url
        self.status = status
        self.body = body

    def __reduce__(self):  # keep the attributes across pickling (Ray, Prefect, multiprocessing)
        return (type(self), self.args, self.__dict__)


class InputNotFoundError(ConfigError, FileNotFoundError):
    """A model, tokenizer, prompt or eval path named in the config does not exist; the message names the config
    field, the path and where the field was set."""


class RunInUseError(StorageError):
    """Another process holds the run's lease (one writer per run); the message names it (host, pid, since)."""


class InvariantError(SlimeError, RuntimeError):
    """A `--ci-test` invariant of a run does not hold (e.g. trainer and engine log-probs disagree); the
    message names the check, the rollout and step, the value and its bound."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be loaded the way it was asked for."""


class UncommittedCheckpointError(CheckpointError, NotCommittedError):
    """The directory has no committed manifest (never a checkpoint, or its save did not finish)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was saved from a different model, layout or schedule than the one loading it."""


class ModelOnlyCheckpointError(CheckpointError):
    """A full training-state resume was asked of a checkpoint that holds the model only."""


class MegatronLMCheckpointError(CheckpointError):
    """A Megatron-LM / slime checkpoint (`latest_checkpointed_iteration.txt` + `iter_NNNNNNN/`) cannot be read
    here: its tracker names a missing iteration, or it is in the legacy `torch` format (`mp_rank_*/*.pt`)."""
