"""A kit's pretrained base (slime/data/pretrain.py): a short pretraining on another task before the kit is saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime.data.pretrain import PretrainRecipe, pretrain, pretraining_conversations
from slime.data.tiny import TinyKitRecipe, build_tokenizer, load_recipe, make_tiny_kit
from slime.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"model": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 64},
         "data": {"num_train": 20, "num_eval": 10, "num_sft": 20}}
QUICK = {"num_examples": 64, "epochs": 4, "batch_size": 16, "lr": 3e-3, "warmup_steps": 2}


def test_conversations_are_the_pretraining_task_not_the_kits():
    rows = pretraining_conversations(PretrainRecipe(ops=["-"], digits=[2], num_examples=50), seed=1)
    assert len(rows) == 50
    for user, assistant in rows:
        a, b = (int(x) for x in user["content"].removesuffix("=").split("-"))
        assert 10 <= b <= a <= 99 and assistant["content"] == str(a - b)
    assert rows == pretraining_conversations(PretrainRecipe(ops=["-"], digits=[2], num_examples=50), seed=1)
    assert rows != pretraining_conversations(PretrainRecipe(ops=["-"], digits=[2], num_examples=50), seed=2)


def test_pretraining_lowers_the_loss_and_is_deterministic():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=384, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(Qwen2ForCausalLM(config))
    start = {k: v.clone() for k, v in models[0].state_dict().items()}
    one_epoch = pretrain(models[0], tokenizer, PretrainRecipe(**{**QUICK, "epochs": 1}), seed=5)
    models[0].load_state_dict(start)
    losses = [pretrain(m, tokenizer, PretrainRecipe(**QUICK), seed=5) for m in models]
    assert losses[0] == losses[1] < one_epoch  # later epochs fit the task better
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(start[k], v) for k, v in models[0].state_dict().items())


def test_a_kit_with_pretrain_records_it_and_one_without_does_not(tmp_path):
    plain = make_tiny_kit(tmp_path / "plain", TinyKitRecipe.model_validate(SMALL))
    based = make_tiny_kit(tmp_path / "based", TinyKitRecipe.model_validate({**SMALL, "pretrain": QUICK}))
    assert "pretrain" not in json.loads(plain.manifest.read_text())["recipe"]  # kits built before it still match
    assert json.loads(based.manifest.read_text())["recipe"]["pretrain"]["epochs"] == 4
    assert (plain.model_dir / "model.safetensors").read_bytes() != (based.model_dir / "model.safetensors").read_bytes()
    assert plain.sft.read_text() == based.sft.read_text()  # the kit's own task data does not change
    with pytest.raises(ConfigError, match="another recipe"):
        make_tiny_kit(tmp_path / "plain", TinyKitRecipe.model_validate({**SMALL, "pretrain": QUICK}))


def test_the_lora_kit_recipe_pretrains_on_subtraction_for_an_addition_task(tmp_path):
    recipe = load_recipe(ROOT / "datasets" / "tiny-lora" / "recipe.yaml")
    assert recipe.pretrain is not None and recipe.pretrain.ops == ["-"] and recipe.data.ops == ["+"]
    assert recipe.model == load_recipe().model and recipe.data == load_recipe().data  # otherwise the tiny kit
    bad = tmp_path / "bad.yaml"
    bad.write_text("pretrain:\n  epochs: 0\n")
    with pytest.raises(ConfigError, match="field 'pretrain.epochs'"):
        load_recipe(bad)
