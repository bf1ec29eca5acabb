"""LoRA adapters (`lora:`): the section, the HF -> Megatron names of the layers that take them, and the check of
LoRA against the trainer's partial-training lists."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from slime.config.base import ConfigTree, Fail, _Section

# HF module names (what PEFT and SGLang's --lora-target-modules use) -> the megatron-core linear holding them
LORA_HF_TO_MEGATRON = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                       "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
LORA_MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LoraConfig(_Section):
    """LoRA adapters on the Megatron trainer's linear layers (docs/lora.md): base weights frozen, engines get
    base + scale * B @ A."""

    lora_rank: int = Field(0, ge=0, description="adapter rank r; 0: LoRA off (full fine-tuning)")
    lora_alpha: float = Field(16.0, gt=0, description="scale = lora_alpha / lora_rank, as in PEFT")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (training only)")
    target_modules: list[str] = Field(["all-linear"], min_length=1, description="all-linear, or HF names (q_proj "
                                      "k_proj v_proj o_proj gate_proj up_proj down_proj) or Megatron ones (linear_qkv "
                                      "linear_proj linear_fc1 linear_fc2); a comma-separated string also works. q/k/v "
                                      "and gate/up are fused in Megatron: name all of a fused group or none")
    lora_adapter_path: str | None = Field(None, description="start from the adapters of this LoRA checkpoint "
                                                            "(iter_* dir or --save root) instead of fresh ones")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list) and all(isinstance(v, str) for v in items):
            return [part.strip() for v in items for part in v.split(",") if part.strip()]
        return value

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        lora_megatron_targets(value)  # raises on a name that cannot map or a partial fused group
        return value

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def megatron_targets(self) -> list[str]:
        """The Megatron linear layers that get adapters, in model order."""
        return lora_megatron_targets(self.target_modules)


def lora_megatron_targets(names: list[str]) -> list[str]:
    """`target_modules` as Megatron linear names. Refuses an unknown name, and a fused layer named only in part
    (q_proj without k_proj and v_proj: one adapter on linear_qkv would change all three)."""
    if "all-linear" in names:
        if len(names) > 1:
            raise ValueError(f"target_modules: all-linear already names every linear layer; drop {names}")
        return list(LORA_MEGATRON_TARGETS)
    chosen = set()
    for name in names:
        if name in LORA_MEGATRON_TARGETS:
            chosen.add(name)
        elif name in LORA_HF_TO_MEGATRON:
            fused = sorted(k for k, v in LORA_HF_TO_MEGATRON.items() if v == LORA_HF_TO_MEGATRON[name])
            missing = [k for k in fused if k not in names]
            if missing:
                raise ValueError(f"target_modules: {name} lives in Megatron's fused {LORA_HF_TO_MEGATRON[name]} "
                                 f"with {', '.join(k for k in fused if k != name)}; name all of {', '.join(fused)} "
                                 f"(missing {', '.join(missing)}) or none of them")
            chosen.add(LORA_HF_TO_MEGATRON[name])
        else:
            raise ValueError(f"target_modules: {name!r} maps to no Megatron linear layer; use all-linear or "
                             f"{', '.join([*LORA_HF_TO_MEGATRON, *LORA_MEGATRON_TARGETS])}")
    return [t for t in LORA_MEGATRON_TARGETS if t in chosen]


def check_lora(config: ConfigTree, fail: Fail) -> None:
    """LoRA freezes every base weight; an adapter to start from needs LoRA on."""
    if config.lora.enabled:
        for name in ("only_train_params_name_list", "freeze_params_name_list"):
            if getattr(config.train, name):
                fail(f"train.{name}", "LoRA trains the adapters only and freezes every base weight: partial "
                     "training lists do not apply (set lora_rank 0 to use them)", "lora.lora_rank")
    elif config.lora.lora_adapter_path:
        fail("lora.lora_adapter_path", "starting from an adapter needs LoRA on: set lora_rank (the adapter's rank)")
