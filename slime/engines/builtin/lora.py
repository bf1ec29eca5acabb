"""SGLang's LoRA endpoints on the built-in engine: `/load_lora_adapter` and `/unload_lora_adapter`.

SGLang keeps adapters beside the base weights and applies the one a request names (`lora_path` in the
/generate body) in its kernels. The built-in engine runs a plain `transformers` model, so it holds **one**
adapter at a time and applies it by merging: each targeted weight becomes `base + scale * B @ A` (computed
in fp32 on the weight's device, then cast to the engine's dtype, as the trainer's merged export does). The base
values of the targeted weights are kept on the side in host memory (pinned on CUDA, so each copy is one DMA), so
loading another adapter replaces the delta (base + new delta, never stacked) and unloading copies the base back
exactly. Those host twins are kept across loads: after an unload the weights equal them again, so the next load
copies nothing to the host; a full weight update marks them stale. Every change is an in-place `copy_` on the
model thread between two decode steps, so parameter storage (and captured CUDA graphs) stay valid. (Measured on
an H100 at 1.5B, rank 64: the merge computed on the host with fresh pageable copies took 4.5 s per adapter sync.)

The adapter directory is read with peft (`LoraConfig.from_pretrained`, `load_peft_weights`): PEFT's key
names (`base_model.model.<module>.lora_A.weight`) name the model's modules. Refused, with a message naming
the field: LoRA not enabled (`--enable-lora`, as SGLang), a rank above `--max-lora-rank`, a target module
outside `--lora-target-modules`, PEFT features that are not a plain merge (DoRA, rank/alpha patterns, bias,
modules_to_save, fan_in_fan_out), a module or shape the model lacks, and an adapter whose
`base_model_name_or_path` is a local directory other than the one the engine was started from.

Departures from SGLang (docs/lora.md): loading a second name replaces the first (SGLang would hold both),
and a request without `lora_path` while an adapter is loaded generates with it (SGLang would use the base).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slime.engines.builtin.sampling import BadRequestError

PEFT_PREFIX = "base_model.model."
# PEFT LoraConfig fields that change what the adapter computes beyond `scale * B @ A`: refused when set.
_UNSUPPORTED = {"use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none", "modules_to_save": None,
                "fan_in_fan_out": False, "layer_replication": None, "lora_bias": False, "target_parameters": None}


@dataclass
class LoadedAdapter:
    """SGLang's LoRARef: what /load_lora_adapter answers in `loaded_adapters`."""

    lora_name: str
    lora_path: str
    lora_id: str
    pinned: bool = False


class LoraAdapters:
    """The engine's one adapter slot: load (merge into the weights), unload (restore the base), request checks."""

    def __init__(self, model: torch.nn.Module, run_on_model_thread: Callable[[Callable[[], Any]], Any], *,
                 enabled: bool, max_rank: int | None, target_modules: list[str] | None, model_path: str) -> None:
        self.model = model
        self._run = run_on_model_thread
        self.enabled = enabled
        self.max_rank = max_rank
        self.target_modules = set(target_modules or []) - {"all"} or None  # None: any module (SGLang's "all")
        self.model_path = model_path
        self.active: LoadedAdapter | None = None
        self._twins: dict[str, torch.Tensor] = {}  # weight name -> a host copy of its base values, kept across loads
        self._current: set[str] = set()  # the names whose twin holds the weight's present base values
        self._merged: list[str] = []  # the names whose weight holds base + delta now

    # ------------------------------------------------------------------ endpoints

    def load(self, lora_name: Any, lora_path: Any, pinned: bool = False) -> dict[str, Any]:
        """/load_lora_adapter: merge the PEFT adapter at `lora_path` under `lora_name` (replacing the one held)."""
        try:
            self._require_enabled()
            if not isinstance(lora_name, str) or not lora_name or not isinstance(lora_path, str) or not lora_path:
                raise BadRequestError("load_lora_adapter needs 'lora_name' and 'lora_path' (non-empty strings)")
            if self.active is not None and self.active.lora_name == lora_name:
                raise BadRequestError(f"LoRA with name {lora_name} already exists. Loaded LoRAs: {self.names()}; "
                                      "unload it first")
            deltas = self._read(lora_path)
            self._run(lambda: self._apply(deltas))
        except BadRequestError as exc:
            return self._answer(False, str(exc))
        self.active = LoadedAdapter(lora_name, lora_path, uuid.uuid4().hex, bool(pinned))
        return self._answer(True)

    def unload(self, lora_name: Any) -> dict[str, Any]:
        """/unload_lora_adapter: copy the base values back (bit-exact) and forget the adapter."""
        try:
            self._require_enabled()
            if self.active is None or self.active.lora_name != lora_name:
                raise BadRequestError(f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {self.names()}")
            self._run(self._restore)
        except BadRequestError as exc:
            return self._answer(False, str(exc))
        self.active = None
        return self._answer(True)

    def check_request(self, lora_path: Any) -> None:
        """A /generate item's `lora_path`: None (the loaded adapter, or the base when none) or the loaded name."""
        if lora_path is None:
            return
        if not isinstance(lora_path, str):
            raise BadRequestError(f"lora_path must be a string (an adapter name), got {lora_path!r:.60}")
        if self.active is None or lora_path != self.active.lora_name:
            raise BadRequestError(f"The following requested LoRA adapters are not loaded: {lora_path}\n"
                                  f"Loaded adapters: {self.names()}.")

    def names(self) -> list[str]:
        return [self.active.lora_name] if self.active else []

    def check_full_update(self) -> None:
        """A full weight update while an adapter is merged would leave stale base values: refused."""
        if self.active is not None:
            raise BadRequestError(f"LoRA adapter {self.active.lora_name!r} is loaded (merged into the weights): "
                                  "unload it (/unload_lora_adapter) before a full weight update")
        self._current.clear()  # the update changes the base: the host twins are stale

    # ------------------------------------------------------------------ reading and merging

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise BadRequestError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")

    def _read(self, path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """weight name -> (A, B, scale) of the adapter at `path` (fp32, host), every refusal checked first; the
        product is formed on the model thread, on the weight's device (`_apply`)."""
        from peft import LoraConfig
        from peft.utils import load_peft_weights

        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise BadRequestError(f"lora_path {path}: no adapter_config.json (not a PEFT adapter directory)")
        try:
            config = LoraConfig.from_pretrained(path)
            tensors = load_peft_weights(path, device="cpu")
        except Exception as exc:  # peft's own message names what it could not read
            raise BadRequestError(f"lora_path {path}: cannot read the PEFT adapter ({type(exc).__name__}: {exc})") from None
        for name, neutral in _UNSUPPORTED.items():
            value = getattr(config, name, neutral)
            if value is not None and value != neutral:
                raise BadRequestError(f"lora_path {path}: adapter_config.json {name}={value!r} is not supported by "
                                      "the built-in engine (a plain LoRA merge only)")
        if self.max_rank is not None and config.r > self.max_rank:
            raise BadRequestError(f"lora_path {path}: adapter rank r={config.r} exceeds --max-lora-rank {self.max_rank}")
        self._check_base(path, config.base_model_name_or_path)
        scale = config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)
        params = dict(self.model.named_parameters())
        deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        pairs = {key.removesuffix(".lora_A.weight") for key in tensors if key.endswith(".lora_A.weight")}
        stray = sorted(k for k in tensors if k.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")
                       not in pairs)
        if stray or not pairs:
            raise BadRequestError(f"lora_path {path}: expected lora_A/lora_B pairs, found {stray[:3] or 'none'}")
        for module in sorted(pairs):
            short = module.rsplit(".", 1)[-1]
            if self.target_modules is not None and short not in self.target_modules:
                raise BadRequestError(f"lora_path {path}: adapter targets {short}, which is not in --lora-target-modules "
                                      f"{sorted(self.target_modules)}")
            weight_name = module.removeprefix(PEFT_PREFIX) + ".weight"
            a, b = tensors[f"{module}.lora_A.weight"].float(), tensors[f"{module}.lora_B.weight"].float()
            weight = params.get(weight_name)
            if weight is None:
                raise BadRequestError(f"lora_path {path}: adapter module {module!r} is not a module of the model "
                                      f"({weight_name} not found)")
            if a.shape[0] != config.r or b.shape[1] != config.r or (b.shape[0], a.shape[1]) != tuple(weight.shape):
                raise BadRequestError(f"lora_path {path}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                                      f"which do not make a rank-{config.r} update of {weight_name} {list(weight.shape)}")
            deltas[weight_name] = (a, b, scale)
        return deltas

    def _check_base(self, path: str, base: str | None) -> None:
        """Refuse an adapter recorded on another local base directory than the engine's (when both are local)."""
        if base and os.path.isdir(base) and os.path.isdir(self.model_path) \
                and os.path.realpath(base) != os.path.realpath(self.model_path):
            raise BadRequestError(f"lora_path {path}: the adapter's base_model_name_or_path is {base}, but this engine "
                                  f"serves {self.model_path}; load it on an engine started from its base")

    @torch.no_grad()
    def _apply(self, deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Model thread: restore any merged adapter, then base + scale * B @ A for every weight of the new one."""
        self._restore()
        params = dict(self.model.named_parameters())
        for name, (a, b, scale) in deltas.items():
            weight = params[name]
            if name not in self._twins:
                self._twins[name] = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=weight.is_cuda)
            if name not in self._current:  # ordered before the merge below on the same stream
                self._twins[name].copy_(weight.detach(), non_blocking=True)
                self._current.add(name)
            delta = scale * (b.to(weight.device) @ a.to(weight.device))
            weight.copy_(weight.float() + delta)
            self._merged.append(name)

    @torch.no_grad()
    def _restore(self) -> None:
        params = dict(self.model.named_parameters())
        for name in self._merged:
            params[name].copy_(self._twins[name], non_blocking=True)
        self._merged = []

    def _answer(self, success: bool, message: str | None = None) -> dict[str, Any]:
        """SGLang's LoRAUpdateOutput."""
        loaded = {self.active.lora_name: vars(self.active)} if self.active else {}
        return {"success": success, "error_message": message, "loaded_adapters": loaded}
