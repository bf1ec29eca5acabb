"""`slime sft` end to end on the tiny kit (CPU): loss falls, the checkpoint is committed and exports."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

SLIME = shutil.which("slime", path=str(Path(sys.executable).parent))


def test_sft_lowers_loss_commits_and_exports(tiny_kit, tmp_path):
    save, out = tmp_path / "sft", tmp_path / "hf"
    result = subprocess.run([SLIME, "sft", "--hf-checkpoint", str(tiny_kit.model_dir),
                             "--sft-data", f"{tiny_kit.sft}@[0:256]", "--save", str(save),
                             "--global-batch-size", "64", "--micro-batch-size", "32", "--lr", "3e-3",
                             "--sft-num-epoch", "2"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["steps"] == 8  # 256 conversations / 64 per step x 2 epochs
    assert summary["last_loss"] < 0.7 * summary["first_loss"], summary
    manifest = json.loads((save / "iter_0000008" / "manifest.json").read_text())
    assert manifest["metadata"]["stage"] == "sft" and len(manifest["metadata"]["sft_losses"]) == 8
    # a checkpoint saved from the DDP-wrapped training model exports like a converted one
    export = subprocess.run([SLIME, "export", "--load", str(save), "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 384


def test_sft_needs_its_data():
    result = subprocess.run([SLIME, "sft", "--hf-checkpoint", "x", "--save", "y"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "stage 'sft' needs: sft.sft_data (--sft-data)" in result.stderr
