"""LoRA through the stages on the tiny kit (CPU): `slime sft --lora-rank` trains adapters only (the loss falls,
the checkpoint holds the adapters and the base's hash), `slime export` writes merged HF weights and, with
`--merge false`, a PEFT adapter directory; both give the same model, which differs from the base."""

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from slime.errors import ConfigError

SLIME = shutil.which("slime", path=str(Path(sys.executable).parent))
LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear"]


def run(*args: str, timeout: float = 600) -> dict:
    result = subprocess.run([SLIME, *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


@pytest.fixture(scope="module")
def lora_sft(tiny_kit, tmp_path_factory):
    save = tmp_path_factory.mktemp("lora-sft") / "sft"
    summary = run("sft", "--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:256]",
                  "--save", str(save), "--global-batch-size", "64", "--micro-batch-size", "32", "--sft-lr", "3e-2",
                  "--sft-lr-warmup-iters", "1", "--sft-num-epoch", "2", *LORA)
    return save, summary


def test_lora_sft_trains_the_adapters_and_saves_only_them(lora_sft, tiny_kit):
    save, summary = lora_sft
    assert summary["steps"] == 8 and summary["last_loss"] < 0.9 * summary["first_loss"], summary
    assert summary["lora_rank"] == 8 and 0 < summary["trainable_params"] < summary["total_params"] / 5, summary
    meta = json.loads((save / "iter_0000008" / "manifest.json").read_text())["metadata"]
    assert meta["lora"]["base"]["source"] == str(tiny_kit.model_dir)
    assert meta["lora"]["targets"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _log_probs(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1)


def test_lora_export_merged_and_peft_give_the_same_model(lora_sft, tiny_kit, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    save, _ = lora_sft
    exports = [["--output-dir", str(tmp_path / "merged")], ["--output-dir", str(tmp_path / "peft"), "--merge", "false"]]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two processes, mostly imports on one core each: side by side
        merged, adapter = pool.map(lambda args: run("export", "--load", str(save), *args, timeout=300), exports)
    assert merged["format"] == "merged" and adapter["format"] == "peft"
    assert (tmp_path / "peft" / "adapter_config.json").is_file() and not (tmp_path / "peft" / "config.json").exists()
    # trained on the HF model itself: that is the PEFT base, loadable, no warning
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_kit.model_dir) and "warning" not in adapter
    meta = json.loads((tmp_path / "peft" / "manifest.json").read_text())["metadata"]
    assert meta["peft_base"] == {"base_model_name_or_path": str(tiny_kit.model_dir),
                                 "lora_base": str(tiny_kit.model_dir), "hf_loadable": True}
    tokens = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32)
    untouched = _log_probs(base, tokens)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    assert (_log_probs(full, tokens) - _log_probs(peft, tokens)).abs().max() < 1e-5
    assert (_log_probs(full, tokens) - untouched).abs().max() > 1e-2


@pytest.mark.slow  # ~90 s on 2 loaded cores; the bit-exact LoRA resume of test_checkpoint_resume.py runs in CI
def test_interrupted_lora_sft_resumes_to_the_same_adapters(tiny_kit, tmp_path):
    from test_sft_stage import model_weights, stopped_copy

    flags = ["sft", "--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:32]",
             "--global-batch-size", "16", "--micro-batch-size", "16", "--sft-lr", "1e-2", "--sft-num-epoch", "2",
             "--sft-save-interval", "3", "--lora-dropout", "0.1", *LORA]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(*flags, "--save", str(whole))
    stopped_copy(whole, cut, 3)  # a run stopped right after its step-3 save
    resumed = run(*flags, "--save", str(cut))
    assert resumed["resumed_from"] == str(cut / "iter_0000003")
    final_whole, final_cut = model_weights(whole / "iter_0000004"), model_weights(cut / "iter_0000004")
    assert sorted(final_whole) == sorted(final_cut) and all(k.endswith(("lora_a", "lora_b")) for k in final_whole)
    assert len(final_whole) == 2 * 4 * 4  # A and B of 4 linear layers in each of the test kit's 4 layers
    for name, tensor in final_whole.items():
        assert torch.equal(tensor, final_cut[name]), name


@pytest.mark.slow  # ~150 s on 2 loaded cores: a full SFT, a LoRA SFT on it and three exports
def test_peft_export_of_adapters_on_a_trained_checkpoint_names_that_checkpoint(tiny_kit, tmp_path):
    """LoRA on a full SFT checkpoint (--load): the adapters belong to that checkpoint, not to the origin HF model.
    `--merge false` records the checkpoint as base_model_name_or_path and warns (manifest, result) that it is
    no HF model; the adapter on the checkpoint's own HF export is the merged model; on the origin it is not."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from slime.stages.export_check import load_exported

    data = ["--sft-data", f"{tiny_kit.sft}@[0:64]", "--global-batch-size", "32", "--micro-batch-size", "32",
            "--sft-lr", "3e-2", "--sft-lr-warmup-iters", "1", "--sft-num-epoch", "1"]
    run("sft", "--hf-checkpoint", str(tiny_kit.model_dir), "--save", str(tmp_path / "full"), *data)
    full = tmp_path / "full" / "iter_0000002"
    run("sft", "--hf-checkpoint", str(tiny_kit.model_dir), "--load", str(tmp_path / "full"), "--save",
        str(tmp_path / "lora"), *data, *LORA)
    assert json.loads((tmp_path / "lora" / "iter_0000002" / "manifest.json").read_text())["metadata"]["lora"][
        "base"]["source"] == str(full)
    adapter = run("export", "--load", str(tmp_path / "lora"), "--output-dir", str(tmp_path / "peft"), "--merge",
                  "false", timeout=300)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(full)  # not the origin HF directory
    meta = json.loads((tmp_path / "peft" / "manifest.json").read_text())["metadata"]["peft_base"]
    assert meta["hf_loadable"] is False and meta["lora_base"] == str(full)
    assert f"trained on the Megatron checkpoint {full}" in meta["warning"] and adapter["warning"] == meta["warning"]
    with pytest.raises(ConfigError, match=f"not a local HF model directory.*trained on the Megatron checkpoint {full}"):
        load_exported(str(tmp_path / "peft"))  # what `slime export-check` of this directory says

    run("export", "--load", str(tmp_path / "lora"), "--output-dir", str(tmp_path / "merged"), timeout=300)
    run("export", "--load", str(full), "--output-dir", str(tmp_path / "base"), timeout=300)  # the warning's advice
    tokens = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    merged = _log_probs(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32), tokens)
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                                        str(tmp_path / "peft")).eval()
    assert (merged - _log_probs(on_base, tokens)).abs().max() < 1e-5
    on_origin = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32),
                                          str(tmp_path / "peft")).eval()
    assert (merged - _log_probs(on_origin, tokens)).abs().max() > 1e-2  # the base the old export named
