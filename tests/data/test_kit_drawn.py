"""The drawn-weights writer of large kits (slime/data/tiny.py `write_drawn_weights`, `model.dtype: bfloat16`): the
7B kit's recipe (datasets/gpu-7b/recipe.yaml) with its shape shrunk goes through the same path as the 7B: weights
drawn per tensor on threads, written in safetensors shards with their index, which transformers loads in bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from slime.data import tiny
from slime.data.tiny import TinyKitRecipe, build_tokenizer, make_tiny_kit, write_drawn_weights
from slime.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
RECIPE_7B = ROOT / "datasets" / "gpu-7b" / "recipe.yaml"
SHRUNK = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_multiple": 512}


def shrunk_recipe(**data: int) -> TinyKitRecipe:
    raw = yaml.safe_load(RECIPE_7B.read_text())
    raw["model"].update(SHRUNK)
    raw["data"].update({"num_train": 20, "num_eval": 10, "num_sft": 20, **data})
    return TinyKitRecipe.model_validate(raw)


def test_the_7b_recipe_is_qwen2_5_7b_shaped_in_bf16():
    from slime.data.random_models import QWEN2_SHAPES

    recipe = tiny.load_recipe(RECIPE_7B)
    shape = QWEN2_SHAPES["7b"]
    model = recipe.model
    assert model.dtype == "bfloat16" and recipe.pretrain is None and model.moe is None
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "tie_word_embeddings"):
        assert getattr(model, key) == shape[key], key
    assert tiny.padded_vocab_size(len(build_tokenizer(recipe)), model.vocab_multiple) == shape["vocab_size"]
    # the gpu-small kit's task
    assert recipe.data == tiny.load_recipe(ROOT / "datasets" / "gpu-small" / "recipe.yaml").data


def test_a_shrunk_7b_kit_is_sharded_bf16_that_transformers_loads(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(tiny, "KIT_SHARD_BYTES", 40_000)  # the 7B's 5 GB shards, scaled to this model
    kit = make_tiny_kit(tmp_path / "kit", shrunk_recipe())
    files = sorted(p.name for p in kit.model_dir.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                           for i in range(1, len(shards) + 1)]
    assert "model.safetensors.index.json" in files and not [f for f in files if f.startswith(".")]
    index = json.loads((kit.model_dir / "model.safetensors.index.json").read_text())
    state = {}
    for shard in shards:
        part = load_file(kit.model_dir / shard)
        assert all(index["weight_map"][name] == shard for name in part)
        state.update(part)
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    manifest = json.loads(kit.manifest.read_text())
    assert manifest["recipe"]["model"]["dtype"] == "bfloat16"
    assert manifest["param_count"] == sum(t.numel() for t in state.values())
    assert json.loads((kit.model_dir / "config.json").read_text())["dtype"] == "bfloat16"

    # drawn as transformers initialises: N(0, 0.02) weights, zero biases and padding row, unit norms, untied lm_head
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert torch.equal(state["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert not state["model.layers.0.self_attn.q_proj.bias"].any()
    embed = state["model.embed_tokens.weight"].float()
    pad = build_tokenizer().pad_token_id
    assert not embed[pad].any() and embed[pad + 1].any()
    assert abs(embed.std().item() - 0.02) < 0.001 and abs(embed.mean().item()) < 0.001
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])

    model = AutoModelForCausalLM.from_pretrained(kit.model_dir, dtype="auto").eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    loaded = model.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()


def test_drawn_weights_depend_on_the_seed_alone(tmp_path):
    recipe = shrunk_recipe()
    tokenizer = build_tokenizer(recipe)
    config = tiny._model_config(recipe.model, 512, {"pad_token_id": tokenizer.pad_token_id})
    blobs = {}
    for name, seed, workers in [("one", 1, 1), ("three", 1, 3), ("other", 2, 3)]:
        write_drawn_weights(tmp_path / name, config, seed, workers=workers, max_shard_bytes=60_000)
        blobs[name] = {p.name: p.read_bytes() for p in sorted((tmp_path / name).iterdir())}
    assert blobs["one"] == blobs["three"]  # any number of threads, same bytes
    assert blobs["one"]["config.json"] == blobs["other"]["config.json"]
    assert {k: v for k, v in blobs["one"].items() if k.endswith(".safetensors")} != \
        {k: v for k, v in blobs["other"].items() if k.endswith(".safetensors")}


@pytest.mark.parametrize(("extra", "message"), [
    ({"model": {"dtype": "bfloat16", "moe": {"num_experts": 4}}}, "dense models only"),
    ({"model": {"dtype": "bfloat16"}, "pretrain": {}}, "must be float32"),
    ({"model": {"dtype": "float16"}}, "model.dtype"),
])
def test_drawn_weights_refuse_what_they_cannot_make(tmp_path, extra, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(extra))
    with pytest.raises(ConfigError, match=message):
        tiny.load_recipe(path)
