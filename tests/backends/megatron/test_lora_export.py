"""The base a `--merge false` PEFT export names (slime/backends/megatron/lora_export.py): the model the adapters
were trained on, as peft writes it into adapter_config.json."""

import json

import pytest
import torch

from slime.backends.megatron.lora import LoraSpec
from slime.backends.megatron.lora_export import peft_base, write_peft_adapter
from slime.storage import commit_directory


def _checkpoint(path, metadata):
    path.mkdir()
    (path / "weights.distcp").write_bytes(b"w")
    commit_directory(str(path), "checkpoint", metadata=metadata)
    return str(path)


def test_peft_base_is_the_hf_model_the_adapters_were_trained_on(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert peft_base(str(hf)) == {"base_model_name_or_path": str(hf), "lora_base": str(hf), "hf_loadable": True}
    conversion = _checkpoint(tmp_path / "convert", {"stage": "convert", "origin_hf_dir": str(hf)})
    # a conversion holds the HF model's weights: peft applies the adapters to that model
    assert peft_base(conversion) == {"base_model_name_or_path": str(hf), "lora_base": conversion, "hf_loadable": True}
    trained = _checkpoint(tmp_path / "sft", {"stage": "sft", "origin_hf_dir": str(hf)})
    base = peft_base(trained)  # trained weights: the origin would be another model; the checkpoint is named
    assert base["base_model_name_or_path"] == trained and base["hf_loadable"] is False
    assert f"trained on the Megatron checkpoint {trained} (stage 'sft')" in base["warning"]
    assert f"slime export --load {trained}" in base["warning"]


def test_adapter_config_records_the_base_given_not_the_hf_configs_directory(tmp_path):
    """peft's get_peft_model renames base_model_name_or_path to the model's own name_or_path (the directory its
    HF config was read from, the export's origin): the writer must keep the base it is given."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path / "origin")
    hf_config = AutoConfig.from_pretrained(tmp_path / "origin")
    modules = ["q_proj", "k_proj", "v_proj"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = get_peft_model_state_dict(get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=modules)))
    state = {name: torch.randn(tensor.shape) for name, tensor in shapes.items()}
    spec = LoraSpec(rank=2, alpha=4, dropout=0.0, targets=("linear_qkv",))
    with pytest.warns(UserWarning, match="base_model_name_or_path"):  # peft's rename, which the writer undoes
        write_peft_adapter(state, spec, str(tmp_path / "adapter"), base_model="/runs/sft/iter_0000002",
                           hf_config=hf_config)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "/runs/sft/iter_0000002"
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (2, 4, sorted(modules))
