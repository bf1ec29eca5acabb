"""LoRA adapters on megatron-core's tensor-parallel linear layers (Hu et al. 2021, "LoRA", eq. 3):

    y = W x + scale * B (A dropout(x)),   A: [r, in], B: [out, r], scale = lora_alpha / r

Each targeted `ColumnParallelLinear` / `RowParallelLinear` (`linear_qkv`, `linear_proj`, `linear_fc1`,
`linear_fc2`) gets two parameters beside its frozen `weight`, `lora_a` and `lora_b`, and its forward is
wrapped on the instance (no class is patched). Tensor parallelism splits them as the weight is split:

* column-parallel (W split by output rows): A is whole on every rank, B holds this rank's output rows.
  A's output is passed through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce
  backward), so A's gradient and the input gradient from the adapter are the full sums on every rank;
* row-parallel (W split by input columns, x already split): A holds this rank's input columns, B is
  whole; A's partial output is all-reduced (`reduce_from_tensor_model_parallel_region`) before B.

Split parameters carry megatron's `tensor_model_parallel` attributes, so gradient clipping counts each
element once. B starts at zero (the model at init is the base exactly); A is drawn like PEFT's (Kaiming
uniform, a = sqrt(5)) from a generator seeded by the run seed and the layer name, whole and then sliced,
so every tensor-parallel layout starts from the same adapters and the global RNG is left untouched.
Base weights are frozen before DDP wraps the model (`lora_callback` is an mbridge post-creation callback),
so they get no gradient buffer and no optimizer state; under bf16 the adapters are bf16 like every
parameter and the optimizer keeps their fp32 master copies.

What the rest of the trainer uses: `adapters_disabled` / `reference_adapters` (the KL reference is the
frozen base, or base + a snapshot of the starting adapters, in the same model), `merged_weight` (export
and weight sync send base + scale * B @ A), `adapter_sharded_state_dict` (checkpoints hold the adapters
only) and `set_base`/`check_base` (a content hash of the base those adapters belong to).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import types
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from slime.errors import CheckpointMismatchError, ConfigError

ADAPTER_PARAMS = ("lora_a", "lora_b")


@dataclass(frozen=True)
class LoraSpec:
    """What the adapters are: rank, alpha, dropout, the Megatron linear names they sit on, and the seed of A."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, config: Any) -> LoraSpec | None:
        """The spec of `config.lora` (a `slime.config.Config`), None when LoRA is off."""
        lora = config.lora
        if not lora.enabled:
            return None
        return cls(rank=lora.lora_rank, alpha=lora.lora_alpha, dropout=lora.lora_dropout,
                   targets=tuple(lora.megatron_targets()), seed=config.run.seed)

    def signature(self) -> dict[str, Any]:
        """What a checkpoint's adapters must share with the model loading them (not the dropout or seed)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


class _State:
    """Per-layer adapter settings, kept on the layer as `_lora`: `collective` is the TP mapping of the rank-r
    activation, None at TP 1 (megatron's mappings are identities there; skipping them saves an autograd node)."""

    def __init__(self, spec: LoraSpec, column: bool, tp: int) -> None:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        self.spec, self.column, self.enabled = spec, column, True
        self.collective: Callable[[torch.Tensor], torch.Tensor] | None = None
        if tp > 1:
            self.collective = copy_to_tensor_model_parallel_region if column else reduce_from_tensor_model_parallel_region


def is_adapter_name(name: str) -> bool:
    """Whether a Megatron parameter / state-dict name is an adapter's (`...linear_qkv.lora_a`)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMS


def lora_callback(spec: LoraSpec | None) -> Callable[..., None] | None:
    """An mbridge post-model-creation callback adding the adapters (None when LoRA is off)."""
    if spec is None:
        return None

    def callback(model: torch.nn.Module, **_: Any) -> None:
        add_adapters(model, spec)

    return callback


def add_adapters(model: torch.nn.Module, spec: LoraSpec) -> int:
    """Freeze every parameter of `model`, then give each targeted linear layer its adapters; the number of
    layers adapted."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if getattr(getattr(model, "config", None), "num_moe_experts", None):
        raise ConfigError("LoRA on a mixture-of-experts model is not supported yet: adapters on the experts would "
                          "be one per expert, split over expert-parallel ranks, and the merged-weight export and the "
                          "adapter-only sync here cover models whose weights are all on one pipeline stage without "
                          "expert parallelism (dense models); train the MoE model in full")
    for param in model.parameters():
        param.requires_grad_(False)
    count = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in spec.targets:
            continue
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            raise ConfigError(f"target_modules: {name} is a {type(module).__name__}, not a megatron-core "
                              "ColumnParallelLinear/RowParallelLinear (Transformer Engine layers are not supported)")
        _attach(name, module, spec, column=isinstance(module, ColumnParallelLinear))
        count += 1
    if not count:
        raise ConfigError(f"target_modules {list(spec.targets)}: no such linear layer in the model")
    return count


def _attach(name: str, module: torch.nn.Module, spec: LoraSpec, column: bool) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if getattr(module, "sequence_parallel", False):
        raise ConfigError(f"LoRA on {name}: sequence parallelism is not supported with adapters")
    if column and module.gather_output:
        raise ConfigError(f"LoRA on {name}: a column-parallel layer that gathers its output is not supported")
    if not column and not module.input_is_parallel:
        raise ConfigError(f"LoRA on {name}: a row-parallel layer whose input is not split is not supported")
    weight = module.weight
    tp, tp_rank = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_tensor_model_parallel_rank())
    out_local, in_local = weight.shape
    in_full = in_local if column else in_local * tp
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(spec.rank, in_full, dtype=torch.float32)
    bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)) of a [r, in] weight, as PEFT draws lora_A
    a.uniform_(-bound, bound, generator=generator)
    if not column:
        a = a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
    module.lora_a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    module.lora_b = torch.nn.Parameter(torch.zeros(out_local, spec.rank,
                                                   device=weight.device, dtype=weight.dtype))
    if column:
        set_tensor_model_parallel_attributes(module.lora_b, True, 0, 1)
    else:
        set_tensor_model_parallel_attributes(module.lora_a, True, 1, 1)
    module._lora = _State(spec, column, tp)
    module._lora_base_forward = module.forward
    module.forward = types.MethodType(_forward, module)


def _forward(self: torch.nn.Module, input_: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The layer's own forward plus scale * B @ A @ dropout(x) (see the module docstring for the TP collectives)."""
    output, bias = self._lora_base_forward(input_, *args, **kwargs)
    state: _State = self._lora
    if not state.enabled:
        return output, bias
    x = _dropout(input_, state) if self.training and state.spec.dropout else input_
    h = F.linear(x, self.lora_a)  # [s, b, r]: whole (column) or this rank's partial sum (row)
    if state.collective is not None:
        h = state.collective(h)
    return _AddScaledLinear.apply(output, h, self.lora_b, state.spec.scale), bias


class _AddScaledLinear(torch.autograd.Function):
    """`output + scale * h @ B^T` in one GEMM forward (`addmm`, beta 1, alpha scale) and one per gradient backward
    (`addmm`, beta 0, alpha scale), where autograd's `output + scale * F.linear(h, B)` runs GEMM, mul and add
    forward and mul and two GEMMs backward: the adapted step is launch-bound on a GPU (docs/lora.md), so kernels
    count. A column-parallel layer's output is fresh and nothing saves it for backward, so the sum is written into
    it (`addmm_`: no copy); a row-parallel one's is a view megatron's reduce mapping returns, which autograd
    forbids modifying in place, so it gets a new tensor (a copy and the GEMM)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(h, b)
        ctx.scale = scale
        h2 = h.reshape(-1, h.shape[-1])
        if output._is_view() or not output.is_contiguous():
            return torch.addmm(output.reshape(-1, output.shape[-1]), h2, b.t(), alpha=scale).view(output.shape)
        ctx.mark_dirty(output)
        output.view(-1, output.shape[-1]).addmm_(h2, b.t(), alpha=scale)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, b = ctx.saved_tensors
        flat, h2 = grad.reshape(-1, grad.shape[-1]), h.reshape(-1, h.shape[-1])
        grad_h = grad_b = None  # beta 0: addmm's first argument only gives the shape, its values are ignored
        if ctx.needs_input_grad[1]:
            grad_h = torch.addmm(h2, flat, b, beta=0, alpha=ctx.scale).view(h.shape)
        if ctx.needs_input_grad[2]:
            grad_b = torch.addmm(b, flat.t(), h2, beta=0, alpha=ctx.scale)
        return grad, grad_h, grad_b, None


def _dropout(x: torch.Tensor, state: _State) -> torch.Tensor:
    """Dropout on the adapter's input. A column-parallel input is the same on every TP rank: its mask comes from
    the default generator, which megatron seeds alike on every TP rank. A row-parallel input is this rank's
    slice: under TP its mask comes from megatron's model-parallel generator, which differs per rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if state.column or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return F.dropout(x, state.spec.dropout)
    with get_cuda_rng_tracker().fork():
        return F.dropout(x, state.spec.dropout)


def adapted_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, layer) of every linear layer with adapters, in module order."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "_lora", None), _State):
            yield name, module


def has_adapters(model: torch.nn.Module) -> bool:
    return next(adapted_layers(_unwrap(model)), None) is not None


def spec_of(model: torch.nn.Module) -> LoraSpec | None:
    layer = next(adapted_layers(_unwrap(model)), None)
    return layer[1]._lora.spec if layer else None


@contextlib.contextmanager
def adapters_disabled(models: list[torch.nn.Module]) -> Iterator[None]:
    """Run the frozen base: every adapter is skipped inside the block (the KL reference, no second model)."""
    layers = [layer for model in models for _, layer in adapted_layers(_unwrap(model))]
    before = [layer._lora.enabled for layer in layers]
    for layer in layers:
        layer._lora.enabled = False
    try:
        yield
    finally:
        for layer, enabled in zip(layers, before, strict=True):
            layer._lora.enabled = enabled


def named_adapters(models: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of this rank's adapters (names of the unwrapped model)."""
    for model in models:
        for name, param in _unwrap(model).named_parameters():
            if is_adapter_name(name):
                yield name, param


def adapter_tensors(models: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """A detached copy of this rank's adapter tensors by parameter name (a reference snapshot)."""
    return {name: param.detach().clone() for name, param in named_adapters(models)}


@contextlib.contextmanager
def reference_adapters(models: list[torch.nn.Module], snapshot: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """The KL reference in the training model: the base alone (`snapshot` None), or base + the adapters of
    `snapshot` swapped in for the block (a LoRA policy RL started from). The trained adapters come back after."""
    if snapshot is None:
        with adapters_disabled(models):
            yield
        return
    current = adapter_tensors(models)
    params = dict(named_adapters(models))
    with torch.no_grad():
        for name, value in snapshot.items():
            params[name].copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in current.items():
                params[name].copy_(value)


@torch.no_grad()
def merged_weight(layer: torch.nn.Module) -> torch.Tensor:
    """This rank's shard of base + scale * B @ A for an adapted layer (the same split as `layer.weight`:
    column shards are B's rows times A, row shards B times A's columns), computed in fp32; the base weight
    itself inside `adapters_disabled` (what adapter sync sends engines that need the base)."""
    if not layer._lora.enabled:
        return layer.weight
    spec = layer._lora.spec
    delta = layer.lora_b.float() @ layer.lora_a.float()
    return (layer.weight.float() + spec.scale * delta).to(layer.weight.dtype)


def named_export_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(name, parameter, values to export) of every non-adapter parameter, adapted weights merged."""
    merged = {f"{name}.weight": layer for name, layer in adapted_layers(model)}
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            continue
        yield name, param, merged_weight(merged[name]) if name in merged else param


def count_parameters(models: list[torch.nn.Module]) -> dict[str, int]:
    """Trainable and total parameter elements of this rank (tensor-parallel shards counted as held)."""
    trainable = total = 0
    for model in models:
        for param in model.parameters():
            total += param.numel()
            trainable += param.numel() if param.requires_grad else 0
    return {"trainable": trainable, "total": total}


def adapter_sharded_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """megatron ShardedTensors of the adapters only (a LoRA checkpoint's model part): B split by rows on
    column-parallel layers, A by columns on row-parallel ones, the other replicated."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out: dict[str, Any] = {}
    for name, layer in adapted_layers(_unwrap(model)):
        axis = {"lora_b": 0} if layer._lora.column else {"lora_a": 1}
        out.update(make_sharded_tensors_for_checkpoint({"lora_a": layer.lora_a, "lora_b": layer.lora_b},
                                                       f"{name}.", axis))
    return out


# ----------------------------------------------------------------------------- the base the adapters belong to


def set_base(models: list[torch.nn.Module], source: str) -> dict[str, str]:
    """Record which base weights the adapters of `models` sit on: `source` (an HF directory or a committed
    checkpoint) and its content hash. LoRA checkpoints store it; loading adapters checks it."""
    pointer = {"source": source, "sha256": base_hash(source)}
    for model in models:
        _unwrap(model)._slime_lora_base = pointer
    return pointer


def base_of(model: torch.nn.Module) -> dict[str, str] | None:
    return getattr(_unwrap(model), "_slime_lora_base", None)


def check_base(model: torch.nn.Module, saved: dict[str, str] | None, path: str) -> None:
    """Refuse adapters saved on another base than the one loaded into `model`."""
    current = base_of(model)
    if current is None:
        raise ConfigError(f"{path} holds LoRA adapters: load the base weights first (lora.set_base records them)")
    if saved is None or saved.get("sha256") != current["sha256"]:
        raise CheckpointMismatchError(
            f"{path}: its LoRA adapters were trained on base {saved and saved.get('source')!r} (sha256 "
            f"{saved and saved.get('sha256')}), but the base loaded now is {current['source']!r} (sha256 "
            f"{current['sha256']}); load the adapters on the base they were trained on")


_HASHES: dict[tuple[str, float], str] = {}


def base_hash(source: str) -> str:
    """Content hash of base weights: a committed checkpoint's manifest hash (its manifest lists every file's
    checksum), else sha256 over an HF directory's config and weight files (cached per path and mtime)."""
    from slime.storage import is_committed, manifest_hash

    if is_committed(source):
        return manifest_hash(source)
    if not os.path.isdir(source):
        raise ConfigError(f"LoRA base {source!r} is neither a committed checkpoint nor an HF directory")
    names = sorted(n for n in os.listdir(source) if n.endswith((".safetensors", ".bin")) or n == "config.json")
    key = (os.path.abspath(source), max(os.path.getmtime(os.path.join(source, n)) for n in names))
    if key not in _HASHES:
        digest = hashlib.sha256()
        for name in names:
            digest.update(name.encode())
            with open(os.path.join(source, name), "rb") as f:
                for block in iter(lambda: f.read(16 * 1024**2), b""):
                    digest.update(block)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def lora_metadata(model: torch.nn.Module) -> dict[str, Any] | None:
    """What a LoRA checkpoint's manifest records: the spec and the base pointer (None without adapters)."""
    spec = spec_of(model)
    if spec is None:
        return None
    return {**asdict(spec), "targets": list(spec.targets), "base": base_of(model)}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)
