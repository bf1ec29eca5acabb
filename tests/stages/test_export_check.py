"""The exported-model check: plain transformers answers the eval prompts as the evaluate stage scored them,
and a model that differs is caught, prompt by prompt."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.config import load_config
from slime.errors import ConfigError
from slime.stages.evaluate import run_evaluate
from slime.stages.export_check import check_exported_answers


@pytest.fixture(scope="module")
def evaluated(tiny_kit, tmp_path_factory):
    """A greedy eval of the tiny kit's model on 40 held-out prompts (config, eval result)."""
    root = tmp_path_factory.mktemp("export-check")
    config = load_config(overrides=[
        "--store", str(root / "store"), "--run-id", "check", "--hf-checkpoint", str(tiny_kit.model_dir),
        "--eval-prompt-data", "arithmetic", f"{tiny_kit.eval}@[0:40]", "--eval-temperature", "0",
        "--rollout-max-response-len", "6", "--rollout-stop", "<|im_end|>", "--apply-chat-template", "--rm-type",
        "math_verify"])
    return config, run_evaluate(config)


def test_the_evaluated_model_answers_every_prompt_as_scored(tiny_kit, evaluated):
    config, result = evaluated
    check = check_exported_answers(config, str(tiny_kit.model_dir), result["result"], "arithmetic")
    assert check["prompts"] == 40
    assert check["same_answer"] == 40 and check["same_reward"] == 40 and check["mismatches"] == []
    assert check["accuracy_exported"] == check["accuracy_eval"] == result["metrics"]["arithmetic"]["mean_reward"]


def test_a_different_model_is_caught_prompt_by_prompt(tiny_kit, evaluated, tmp_path):
    config, result = evaluated
    other = tmp_path / "other"
    shutil.copytree(tiny_kit.model_dir, other)
    weights = load_file(other / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    weights = {k: v + 0.5 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in weights.items()}
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    check = check_exported_answers(config, str(other), result["result"], "arithmetic")
    assert check["same_answer"] < 40
    assert check["mismatches"] and {"prompt", "eval", "exported", "label"} <= set(check["mismatches"][0])
    assert check["mismatches"][0]["eval"] != check["mismatches"][0]["exported"]


def test_sampled_evals_and_unknown_datasets_are_refused(tiny_kit, evaluated):
    config, result = evaluated
    with pytest.raises(ConfigError, match="temperature 1.0"):
        check_exported_answers(config.model_copy(update={"eval": config.eval.model_copy(
            update={"eval_temperature": 1.0})}), str(tiny_kit.model_dir), result["result"], "arithmetic")
    with pytest.raises(ConfigError, match="'nope' is not in the config"):
        check_exported_answers(config, str(tiny_kit.model_dir), result["result"], "nope")


def test_a_peft_adapter_directory_is_checked_on_its_base(tiny_kit, evaluated, tmp_path):
    """`slime export --merge false` writes a PEFT directory: the check loads base + adapter with peft. A zero
    adapter (peft's default init, B = 0) is the evaluated model; a random one changes answers and is caught."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config, result = evaluated
    for name, init in (("zero", True), ("random", False)):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32)
        peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"],
                                               init_lora_weights=init, base_model_name_or_path=str(tiny_kit.model_dir)))
        peft.save_pretrained(str(tmp_path / name))
    same = check_exported_answers(config, str(tmp_path / "zero"), result["result"], "arithmetic")
    assert same["same_answer"] == 40 and same["mismatches"] == []
    changed = check_exported_answers(config, str(tmp_path / "random"), result["result"], "arithmetic")
    assert changed["same_answer"] < 40 and changed["mismatches"]
    (tmp_path / "nobase").mkdir()
    (tmp_path / "nobase" / "adapter_config.json").write_text(
        (tmp_path / "zero" / "adapter_config.json").read_text().replace(str(tiny_kit.model_dir), "some/hub-model"))
    with pytest.raises(ConfigError, match="not a local HF model directory"):
        check_exported_answers(config, str(tmp_path / "nobase"), result["result"], "arithmetic")
