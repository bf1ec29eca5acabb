"""Which base and which starting adapters a LoRA stage loads (slime/backends/megatron/lora_weights.py), on
committed checkpoint manifests alone (no tensors are read)."""

from pathlib import Path

import pytest

from slime.backends.megatron.lora_weights import adapter_source, base_source, recorded_base
from slime.config import load_config
from slime.errors import ConfigError
from slime.storage import commit_directory


def checkpoint(path: Path, lora_base: str | None = None) -> str:
    """A committed checkpoint directory whose manifest says LoRA (on `lora_base`) or a full model."""
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(b"x")
    lora = {"rank": 4, "alpha": 8.0, "targets": ["linear_qkv"], "base": {"source": lora_base, "sha256": "0" * 64}}
    commit_directory(str(path), "checkpoint", metadata={"lora": lora if lora_base else None})
    return str(path)


def config(*flags: str):
    return load_config(None, ["--lora-rank", "4", "--hf-checkpoint", "/models/hf", *flags])


def test_fresh_adapters_sit_on_the_hf_checkpoint_or_ref_load(tmp_path):
    assert base_source(config()) == "/models/hf" and adapter_source(config()) is None
    ref = checkpoint(tmp_path / "ref" / "iter_0000001")
    assert base_source(config("--ref-load", str(tmp_path / "ref"))) == ref  # a --save root resolves to its newest


def test_a_full_checkpoint_as_load_is_the_base(tmp_path):
    converted = checkpoint(tmp_path / "convert" / "iter_0000000")
    c = config("--load", converted)
    assert base_source(c) == converted and adapter_source(c) is None


def test_adapters_from_a_lora_checkpoint_bring_their_base(tmp_path):
    converted = checkpoint(tmp_path / "convert" / "iter_0000000")
    sft = checkpoint(tmp_path / "sft" / "iter_0000008", lora_base=converted)
    c = config("--load", str(tmp_path / "sft"))  # the pipeline's RL after a LoRA SFT on the conversion
    assert adapter_source(c) == sft and base_source(c) == converted == recorded_base(sft)
    c = config("--lora-adapter-path", sft)
    assert adapter_source(c) == sft and base_source(c) == converted


def test_a_lora_adapter_path_must_be_a_lora_checkpoint(tmp_path):
    full = checkpoint(tmp_path / "full" / "iter_0000001")
    with pytest.raises(ConfigError, match="lora_adapter_path .*not a committed LoRA checkpoint"):
        adapter_source(config("--lora-adapter-path", full))
    with pytest.raises(ConfigError, match="ref_load .* holds LoRA adapters"):
        base_source(config("--ref-load", checkpoint(tmp_path / "l" / "iter_0000001", lora_base=full)))
    with pytest.raises(ConfigError, match="not a LoRA checkpoint with a recorded base"):
        recorded_base(full)
