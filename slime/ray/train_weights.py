"""Host copies of a model's weights (by parameter name) and copying them back: --keep-old-actor, tests."""

from __future__ import annotations

from typing import Any

from slime.errors import ConfigError


def named_params(models: list[Any]) -> dict[str, Any]:
    """The parameters of model chunks by `chunk.name`, without wrapper prefixes (DDP, Float16Module:
    `module.`), so an unwrapped copy of the model has the same names."""
    out = {}
    for chunk, model in enumerate(models):
        for name, param in model.named_parameters():
            while name.startswith("module."):
                name = name[len("module."):]
            out[f"{chunk}.{name}"] = param
    return out


def copy_weights(source: list[Any] | dict[str, Any], target: list[Any]) -> None:
    """Copy the parameters of model chunks `source` (or a `snapshot` of them) into `target`."""
    import torch

    src = source if isinstance(source, dict) else named_params(source)
    dst = named_params(target)
    if src.keys() != dst.keys():
        raise ConfigError(f"cannot copy weights between different models: {sorted(src.keys() ^ dst.keys())[:3]}")
    with torch.no_grad():
        for name, param in dst.items():
            param.copy_(src[name])


def snapshot(models: list[Any]) -> dict[str, Any]:
    """A CPU copy of the models' parameters (slime keeps its model copies on the host as well)."""
    return {name: param.detach().to("cpu", copy=True) for name, param in named_params(models).items()}
