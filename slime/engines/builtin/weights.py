"""In-place weight updates of the built-in engine from tensors: SGLang's tensor and distributed paths.

Two ways in, both with SGLang 0.5.23's request bodies:

* `/update_weights_from_tensor` (same host, colocated): `serialized_named_tensors` holds one entry
  per tensor-parallel rank (this engine has one), each the base64 text of a `torch.multiprocessing`
  `ForkingPickler` dump of a list of `(name, tensor)` pairs, SGLang's `MultiprocessingSerializer`
  format. The tensors themselves do not travel in the body: CPU tensors are shared-memory files
  (the sender pickles with the `file_system` sharing strategy, which works between unrelated
  processes), CUDA tensors are CUDA IPC handles. Only torch's rebuild functions may be named in
  the payload (`decode_named_tensors`), so the endpoint cannot be made to run arbitrary code.
* `/init_weights_update_group` + `/update_weights_from_distributed` (separate hosts/devices): a
  process group of its own (a TCPStore at the trainer plus `ProcessGroupGloo` on CPU or
  `ProcessGroupNCCL` on GPU), never the default group; the trainer (rank 0) broadcasts each named
  tensor in the announced order and this engine (rank `rank_offset`) receives it.

Either way every tensor is checked against the model (name known, shape equal, floating dtype)
before any is applied, then copied into the existing parameters on the model thread between two
steps (`Scheduler.run_command`): the parameters keep their storage, so captured CUDA graphs and the
slot decoder stay valid. Incoming tensors are cast to the engine's dtype, as SGLang's loaders do.
MoE experts may be named one by one (`...mlp.experts.{e}.gate_proj.weight`, as checkpoints and slime's trainer
name them) or by the model's fused parameters (`...mlp.experts.gate_up_proj`); the former are copied into their
block of the fused parameter (`moe.expert_aliases`).

GLM-4.5's multi-token-prediction layers (`model.layers.{num_hidden_layers + i}.*`, `num_nextn_predict_layers`),
which this engine does not load (engine.load_model: no speculative decoding), are skipped in every update with one
log line (`WeightTargets.without_mtp`), as SGLang's loader skips them without speculative decoding: a trainer or
checkpoint that carries them updates the rest.

With tensor parallelism (`--tp-size`, tp_group.py) every path still receives full HF tensors on rank 0 (from the
first `serialized_named_tensors` entry, the disk, or the group), checks them against the full shapes, and
`WeightTargets.copy_in` broadcasts each to the other ranks, every rank copying in its slice (tp_shard.py).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime as dt
import io
import logging
import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slime.engines.builtin.moe import expert_aliases
from slime.engines.builtin.sampling import BadRequestError
from slime.engines.builtin.tp_group import TensorParallel
from slime.engines.builtin.tp_shard import full_shape, shard, split_rule

logger = logging.getLogger(__name__)

# What a ForkingPickler dump of [(name, tensor), ...] may name: torch's rebuild functions, the
# classes they rebuild and the dtype/size objects they take. Anything else is refused.
_ALLOWED_GLOBALS = {
    "torch.multiprocessing.reductions": {"rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
                                         "rebuild_storage_fd", "rebuild_storage_empty", "rebuild_cuda_tensor",
                                         "rebuild_typed_storage_child", "rebuild_nested_tensor",
                                         "rebuild_sparse_coo_tensor"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch": {"Tensor", "Size", "device", "UntypedStorage", "TypedStorage"},
    "torch._utils": {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter"},
    "torch.nn.parameter": {"Parameter"},
    "collections": {"OrderedDict"},
}
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)}
DEFAULT_GROUP_NAME = "weight_update_group"


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as this thread's current CUDA device (a no-op on CPU). HTTP handlers run on worker
    threads, whose current device is cuda:0 whatever the engine's: NCCL communicators, streams and
    `synchronize()` follow the current device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()) or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} may not appear in serialized_named_tensors "
                                     "(only torch tensors and their storages)")


def decode_named_tensors(entry: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """One `serialized_named_tensors` entry -> [(name, tensor)]; BadRequestError if it is not one."""
    try:
        data = base64.b64decode(entry, validate=True) if isinstance(entry, str) else entry
        named = _TensorUnpickler(io.BytesIO(data)).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, ValueError, RuntimeError, TypeError) as exc:
        raise BadRequestError(f"serialized_named_tensors: cannot decode the entry ({type(exc).__name__}: {exc}); "
                              "expected base64 of a ForkingPickler dump of [(name, tensor), ...]") from None
    if isinstance(named, dict):
        named = list(named.items())
    if not (isinstance(named, list | tuple) and all(
            isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named)):
        raise BadRequestError("serialized_named_tensors: the entry must decode to a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in named]


def parse_dtype(name: Any, tensor_name: str) -> torch.dtype:
    key = name.removeprefix("torch.") if isinstance(name, str) else None
    if key not in _DTYPES:
        raise BadRequestError(f"tensor {tensor_name!r}: unknown dtype {name!r}; one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def verify_checksums(received: Sequence[tuple[str, torch.Tensor]], checksums: Any, algorithm: Any) -> None:
    """slime's delta sync over the distributed transport sends the checksum of each tensor's bytes
    (`checksums`, one per name, `checksum_algorithm`; not SGLang fields): every received tensor must match
    before any is applied. Absent: nothing to check (a plain SGLang request)."""
    if checksums is None:
        return
    from slime.delta_codec import CHECKSUM_ALGORITHMS, checksum, host_bytes

    if not isinstance(checksums, list) or len(checksums) != len(received):
        raise BadRequestError(f"checksums must be a list of one checksum per name ({len(received)}), got "
                              f"{type(checksums).__name__} of {len(checksums) if isinstance(checksums, list) else '?'}")
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise BadRequestError(f"checksum_algorithm {algorithm!r}: one of {', '.join(CHECKSUM_ALGORITHMS)}")
    for (name, tensor), expected in zip(received, checksums, strict=True):
        got = checksum(host_bytes(tensor), algorithm)
        if got != expected:
            raise BadRequestError(f"tensor {name!r}: the received bytes have {algorithm} checksum {got}, the trainer "
                                  f"sent {expected}: corrupted in transfer; nothing of this update was applied "
                                  "(sync again: the next sync sends every tensor)")


def mtp_layers(config: Any) -> range:
    """The decoder-layer indices a GLM-4.5 checkpoint gives its multi-token-prediction layers
    (`num_nextn_predict_layers` after the `num_hidden_layers` decoder layers); empty for other models."""
    if getattr(config, "model_type", None) != "glm4_moe":
        return range(0)
    first = config.num_hidden_layers
    return range(first, first + int(getattr(config, "num_nextn_predict_layers", 0) or 0))


def mtp_tensor_names(names: Sequence[str], config: Any) -> list[str]:
    """The names among `names` that belong to `config`'s multi-token-prediction layers (`mtp_layers`)."""
    prefixes = tuple(f"model.layers.{i}." for i in mtp_layers(config))
    return [name for name in names if prefixes and name.startswith(prefixes)]


class WeightTargets:
    """The model's named parameters and persistent buffers, for checking and in-place copies; per-expert names
    of a fused-experts MoE model resolve to blocks of its fused parameters (`aliases`).

    Tensor parallel (`tp`, tp_group.py): names and checks speak of the full HF tensors, each rank holding its slice
    (tp_shard.py). Rank 0's `copy_in` announces the names, broadcasts each full tensor from its device and copies its
    slice; the followers `receive` the same tensors and copy theirs."""

    def __init__(self, model: torch.nn.Module, tp: TensorParallel | None = None) -> None:
        self.model = model
        self.tp = tp
        self.world = tp.world if tp is not None else 1
        self.tensors: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self.aliases = expert_aliases(model)
        self.config = getattr(model, "config", None)

    def without_mtp(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`named` less the tensors of GLM-4.5's multi-token-prediction layers (not served: see the module
        docstring), logged once per update that had any."""
        skipped = set(mtp_tensor_names([name for name, _ in named], self.config))
        if skipped:
            logger.info("weight update: skipped %d multi-token-prediction tensors (e.g. %s): the built-in engine does "
                        "no speculative decoding", len(skipped), min(skipped))
        return [(name, tensor) for name, tensor in named if name not in skipped]

    def target(self, name: str) -> torch.Tensor | None:
        """The tensor `name` writes (a view for a per-expert name, taken now: a memory release may have moved
        the parameter since start), or None if the model has none of that name."""
        if name in self.tensors:
            return self.tensors[name]
        alias = self.aliases.get(name)
        if alias is None:
            return None
        fused, expert, rows = alias
        block = self.tensors[fused][expert]
        return block if rows is None else block[rows]

    def missing(self, names: set[str]) -> list[str]:
        """The model's tensors that `names` (a whole checkpoint) leaves unwritten: neither named themselves nor
        covered by all of their per-expert names."""
        pieces: dict[str, set[str]] = {}
        for alias, (fused, _, _) in self.aliases.items():
            pieces.setdefault(fused, set()).add(alias)
        return sorted(name for name in self.tensors
                      if name not in names and not (name in pieces and pieces[name] <= names))

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The HF (full) shape of tensor `name` (with tensor parallelism: all ranks' slices together)."""
        target = self.target(name)
        return None if target is None else full_shape(name, target.shape, self.world)

    def check(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        """BadRequestError naming the tensor if it cannot be copied into the model."""
        target = self.target(name)
        if target is None:
            raise BadRequestError(f"tensor {name!r} is not a parameter of the model "
                                  f"(the model has {len(self.tensors)}, e.g. {next(iter(self.tensors), None)!r})")
        if tuple(shape) != self.shape(name):
            raise BadRequestError(f"tensor {name!r} has shape {list(shape)}, the model's is {list(self.shape(name))}")
        if target.is_floating_point() and not dtype.is_floating_point:
            raise BadRequestError(f"tensor {name!r} has dtype {dtype}, the model's parameter is {target.dtype}")

    def copy_in(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy (cast) every tensor into its parameter, in place (model thread only); with tensor parallelism
        each rank its slice (see the class docstring)."""
        with torch.no_grad():
            if self.tp is None:
                for name, tensor in named:
                    self.target(name).copy_(tensor)
                return
            self.tp.announce("weights", [(name, list(t.shape), str(t.dtype).removeprefix("torch."))
                                         for name, t in named])
            for name, tensor in named:
                full = tensor.to(self.tp.device).contiguous()
                self.tp.broadcast(full)
                self._copy_slice(name, full)

    def receive(self, specs: Sequence[tuple[str, list[int], str]]) -> None:
        """A follower's side of rank 0's `copy_in`: the same full tensors, in order, each rank's slice copied in."""
        with torch.no_grad():
            for name, shape, dtype in specs:
                full = torch.empty(shape, dtype=_DTYPES[dtype], device=self.tp.device)
                self.tp.broadcast(full)
                self._copy_slice(name, full)

    def _copy_slice(self, name: str, full: torch.Tensor) -> None:
        rule = split_rule(name)
        self.target(name).copy_(full if rule is None else shard(full, rule, self.tp.rank, self.world))


@dataclass
class _Group:
    """One weight-update group this engine joined: its store (kept alive) and process group."""

    store: Any
    group: Any
    rank: int
    world_size: int
    backend: str
    device: torch.device


class WeightChecker:
    """SGLang's /weights_checker actions on the live model, for slime's --check-weight-update-equal:
    `snapshot` copies every parameter and persistent buffer to the host, `reset_tensors` zeroes them (so a
    weight update that skips a tensor cannot pass), `compare` requires each to equal its snapshot exactly.
    With tensor parallelism (`tp`) rank 0 runs each action on every rank, each over its own slices."""

    ACTIONS = ("snapshot", "reset_tensors", "compare")

    def __init__(self, model: torch.nn.Module, tp: TensorParallel | None = None) -> None:
        self.targets = WeightTargets(model)
        self.tp = tp
        self.snapshot: dict[str, torch.Tensor] | None = None

    def run(self, action: Any) -> str:
        """Do `action` (call on the model's thread); a failed comparison raises BadRequestError naming tensors
        (and, with tensor parallelism, the ranks)."""
        if self.tp is not None and self.tp.leader:
            failed = []
            for rank, (status, message) in enumerate(self.tp.gather("check", action), start=1):
                if status != "ok":
                    failed.append(f"rank {rank}: {message}")
            mine = self._run(action)
            if failed:
                raise BadRequestError("weights_checker on tensor-parallel ranks: " + "; ".join(failed))
            return mine
        return self._run(action)

    def _run(self, action: Any) -> str:
        tensors = self.targets.tensors
        if action == "snapshot":
            self.snapshot = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
            return f"snapshot of {len(self.snapshot)} tensors"
        if action == "reset_tensors":
            with torch.no_grad():
                for t in tensors.values():
                    t.zero_()
            return f"reset {len(tensors)} tensors to zero"
        if action == "compare":
            if self.snapshot is None:
                raise BadRequestError("weights_checker compare: no snapshot taken (send action 'snapshot' first)")
            differ = sorted(name for name, t in tensors.items()
                            if name not in self.snapshot or not torch.equal(t.detach().cpu(), self.snapshot[name]))
            if differ:
                raise BadRequestError(f"weights_checker compare: {len(differ)} of {len(tensors)} tensors differ from "
                                      f"the snapshot: {differ[:5]}")
            return f"all {len(tensors)} tensors equal the snapshot"
        raise BadRequestError(f"weights_checker: unknown action {action!r}; actions: {', '.join(self.ACTIONS)}")


class WeightUpdater:
    """Applies tensor and distributed weight updates to a live model through `run_on_model_thread`."""

    def __init__(self, model: torch.nn.Module, device: torch.device,
                 run_on_model_thread: Callable[[Callable[[], Any]], Any], tp: TensorParallel | None = None) -> None:
        self.targets = WeightTargets(model, tp)
        self.device = device
        self._run = run_on_model_thread
        self.groups: dict[str, _Group] = {}
        self.guard: Callable[[], None] = lambda: None  # raises to refuse an update (after receiving, before copying)
        self._lock = threading.Lock()  # one distributed update at a time: receives must stay in order

    # ------------------------------------------------------------------ same host
    def from_tensor(self, serialized_named_tensors: Any, load_format: Any = None) -> str:
        if load_format not in (None, "direct"):
            raise BadRequestError(f"load_format {load_format!r} is not supported by the built-in engine "
                                  "(send a list of (name, tensor) pairs, load_format null)")
        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            raise BadRequestError("serialized_named_tensors must be a non-empty list (one entry per TP rank)")
        # rank 0's entry: with tensor parallelism rank 0 broadcasts the full tensors to the other ranks (copy_in)
        named = self.targets.without_mtp(decode_named_tensors(serialized_named_tensors[0]))
        for name, tensor in named:
            self.targets.check(name, tensor.shape, tensor.dtype)
        self.guard()
        self._run(lambda: self.targets.copy_in(named))
        return f"updated {len(named)} tensors from serialized tensors"

    # ------------------------------------------------------------------ distributed
    def init_group(self, body: dict[str, Any]) -> str:
        address, port = body.get("master_address"), body.get("master_port")
        rank, world_size = body.get("rank_offset"), body.get("world_size")
        group_name = body.get("group_name") or DEFAULT_GROUP_NAME
        backend = body.get("backend") or "nccl"
        if not isinstance(address, str) or not isinstance(port, int) or not isinstance(world_size, int) \
                or not isinstance(rank, int):
            raise BadRequestError("init_weights_update_group needs master_address (str), master_port, "
                                  "rank_offset and world_size (int)")
        if not 0 < rank < world_size:
            raise BadRequestError(f"rank_offset {rank} must be in [1, world_size={world_size}) (rank 0 is the trainer)")
        if backend not in ("gloo", "nccl"):
            raise BadRequestError(f"backend {backend!r}: the built-in engine joins 'gloo' or 'nccl' groups")
        if backend == "nccl" and self.device.type != "cuda":
            raise BadRequestError("backend 'nccl' needs the engine on a CUDA device; this engine runs on "
                                  f"{self.device} (use backend 'gloo')")
        if group_name in self.groups:
            raise BadRequestError(f"group {group_name!r} already exists; /destroy_weights_update_group it first")
        timeout = dt.timedelta(seconds=float(body.get("timeout_s") or 600))
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            with on_device(self.device):
                group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        self.groups[group_name] = _Group(store, group, rank, world_size, backend, self.device)
        logger.info("joined weight update group %r as rank %d of %d (%s, master %s:%d)",
                    group_name, rank, world_size, backend, address, port)
        return f"joined group {group_name!r} as rank {rank} of {world_size} ({backend})"

    def destroy_group(self, group_name: str | None) -> str:
        group_name = group_name or DEFAULT_GROUP_NAME
        if self.groups.pop(group_name, None) is None:
            raise BadRequestError(f"no weight update group {group_name!r}; groups: {sorted(self.groups)}")
        return f"destroyed group {group_name!r}"

    def from_distributed(self, body: dict[str, Any]) -> str:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        group_name = body.get("group_name") or DEFAULT_GROUP_NAME
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) \
                or not len(names) == len(dtypes) == len(shapes) or not names:
            raise BadRequestError("update_weights_from_distributed needs names, dtypes and shapes: "
                                  "non-empty lists of one length")
        group = self.groups.get(group_name)
        if group is None:
            raise BadRequestError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        specs = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if not isinstance(name, str) or not isinstance(shape, list) or \
                    not all(isinstance(n, int) and n >= 0 for n in shape):
                raise BadRequestError(f"tensor {name!r}: name must be a string and shape a list of sizes, got {shape!r}")
            specs.append((name, parse_dtype(dtype, name), shape))
        # Receive everything the trainer broadcasts even when a tensor does not fit the model: the
        # trainer's broadcast would otherwise wait for this rank until the group times out.
        received = []
        with self._lock, on_device(group.device):  # the NCCL communicator is created on the first receive
            for name, dtype, shape in specs:
                buffer = torch.empty(shape, dtype=dtype, device=group.device)
                group.group.broadcast([buffer], dist.BroadcastOptions()).wait()
                received.append((name, buffer))
            if group.device.type == "cuda":
                torch.cuda.synchronize(group.device)
        applied = self.targets.without_mtp(received)
        for name, tensor in applied:
            self.targets.check(name, tensor.shape, tensor.dtype)
        self.guard()
        verify_checksums(received, body.get("checksums"), body.get("checksum_algorithm"))  # one per name sent
        self._run(lambda: self.targets.copy_in(applied))
        return f"updated {len(applied)} tensors from group {group_name!r}"
