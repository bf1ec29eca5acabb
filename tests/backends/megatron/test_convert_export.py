"""HF -> Megatron (mbridge, torch_dist) -> HF on tiny random models of each supported family, on CPU."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_rows import run_script
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

from slime.data.random_models import glm4_moe_config, qwen3_moe_config
from slime.data.tiny import build_tokenizer

SLIME = shutil.which("slime", path=str(Path(sys.executable).parent))
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=128)
FAMILIES = {
    # vocab 300 is not a multiple of 128: Megatron pads it to 384 and export must cut it back
    "qwen2-tied": Qwen2Config(vocab_size=384, tie_word_embeddings=True, **SHAPE),
    "qwen2-untied-odd-vocab": Qwen2Config(vocab_size=300, tie_word_embeddings=False, **SHAPE),
    "llama": LlamaConfig(vocab_size=300, tie_word_embeddings=False, **SHAPE),
    "qwen3": Qwen3Config(vocab_size=300, tie_word_embeddings=True, head_dim=16, **SHAPE),
    # 8 experts top-2 on every layer, experts one tensor each on disk; with and without renormalised top-k
    # weights (Megatron's moe_router_pre_softmax False / True), which only the logits tell apart
    "qwen3-moe": qwen3_moe_config("tiny", max_position_embeddings=128),
    "qwen3-moe-no-renorm": qwen3_moe_config("tiny", max_position_embeddings=128, norm_topk_prob=False),
    # GLM-4.5: a dense first layer, a shared expert, grouped sigmoid routing with an expert bias (drawn in make_model:
    # zeros at init), routed_scaling_factor, half-rotary heads, q/k norms, qkv biases (measured logits gap 1.9e-7)
    "glm4-moe": glm4_moe_config("tiny", max_position_embeddings=128),
}


def make_model(config, out: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's expert bias: exported from megatron's buffer
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def roundtrips(tmp_path_factory):
    root = tmp_path_factory.mktemp("roundtrip")
    args = []
    for name, config in FAMILIES.items():
        args += [str(make_model(config, root / name / "src")), str(root / name)]
    return {Path(row["hf_dir"]).parent.name: row for row in run_script("roundtrip.py", *args, timeout=600)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bit_exact_and_logits_match(roundtrips, family):
    row = roundtrips[family]
    assert row["names_equal"] and row["bit_exact"], row
    assert row["logits_gap"] < 1e-5, row  # fp32, CPU
    exported = AutoModelForCausalLM.from_pretrained(row["export"])
    assert exported.config.vocab_size == FAMILIES[family].vocab_size
    assert len(AutoTokenizer.from_pretrained(row["export"])) == len(build_tokenizer())


def test_cli_convert_and_export_with_manifests(tiny_kit, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    convert = subprocess.run([SLIME, "convert", "--hf-checkpoint", str(tiny_kit.model_dir), "--save", str(ckpt)],
                             capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0, convert.stderr[-2000:]
    result = json.loads(convert.stdout[convert.stdout.index("{"):])
    manifest = json.loads((ckpt / "iter_0000000" / "manifest.json").read_text())
    assert result["checkpoint"] == str(ckpt / "iter_0000000")
    assert manifest["kind"] == "checkpoint" and manifest["metadata"]["model_type"] == "qwen2"
    assert manifest["metadata"]["origin_hf_dir"] == str(tiny_kit.model_dir)
    assert any(f["path"].startswith("model/") for f in manifest["files"])

    # the same conversion again: done already (its record says so), nothing rewritten
    again = subprocess.run([SLIME, "convert", "--hf-checkpoint", str(tiny_kit.model_dir), "--save", str(ckpt)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    reused = json.loads(again.stdout[again.stdout.index("{"):])
    assert reused["reused"] is True and reused["artifacts"]["checkpoint"]["uri"] == result["checkpoint"]
    # another one into the same place: refused, naming the setting
    other = subprocess.run([SLIME, "convert", "--hf-checkpoint", str(tiny_kit.model_dir), "--save", str(ckpt),
                            "--seed", "7"], capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "run.seed: 1234 -> 7" in other.stderr, other.stderr[-2000:]

    export = subprocess.run([SLIME, "export", "--load", str(ckpt), "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["kind"] == "hf_model"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False,
                                         add_generation_prompt=True).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("args", "message"), [
    (["convert", "--hf-checkpoint", "{model}"], "stage 'convert' needs: checkpoint.save (--save)"),
    (["export", "--output-dir", "y"], "stage 'export' needs: checkpoint.load (--load)"),
])
def test_stage_errors_name_the_missing_flag(tiny_kit, args, message):
    # an existing model: a missing one is reported first, before the stage's own checks (tests/test_bad_inputs.py)
    args = [a.format(model=tiny_kit.model_dir) for a in args]
    result = subprocess.run([SLIME, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr


def test_export_refuses_an_uncommitted_checkpoint(tmp_path):
    (tmp_path / "ckpt" / "iter_0000003" / "model").mkdir(parents=True)  # a save that crashed
    result = subprocess.run([SLIME, "export", "--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "o")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "holds no committed checkpoint" in result.stderr
