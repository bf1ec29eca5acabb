"""`slime sft` end to end on the tiny kit (CPU): loss falls, the checkpoint is committed and exports; an
interrupted SFT resumes from its newest checkpoint to the weights of an uninterrupted one."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SLIME = shutil.which("slime", path=str(Path(sys.executable).parent))


def test_sft_lowers_loss_commits_and_exports(tiny_kit, tmp_path):
    save, out = tmp_path / "sft", tmp_path / "hf"
    result = subprocess.run([SLIME, "sft", "--hf-checkpoint", str(tiny_kit.model_dir),
                             "--sft-data", f"{tiny_kit.sft}@[0:256]", "--save", str(save),
                             "--global-batch-size", "64", "--micro-batch-size", "32", "--lr", "1e-6",
                             "--sft-lr", "3e-3", "--sft-lr-warmup-iters", "1", "--sft-num-epoch", "2"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["steps"] == 8  # 256 conversations / 64 per step x 2 epochs
    assert summary["last_loss"] < 0.7 * summary["first_loss"], summary
    manifest = json.loads((save / "iter_0000008" / "manifest.json").read_text())
    assert manifest["metadata"]["stage"] == "sft" and len(manifest["metadata"]["sft_losses"]) == 8
    # SFT's own schedule (sft_lr, sft_lr_warmup_iters) replaced train's lr (1e-6 would not lower the loss)
    scheduler = json.loads((save / "iter_0000008" / "training_state.json").read_text())["scheduler"]
    assert (scheduler["max_lr"], scheduler["lr_warmup_steps"]) == (3e-3, 1)
    # a checkpoint saved from the DDP-wrapped training model exports like a converted one
    export = subprocess.run([SLIME, "export", "--load", str(save), "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 384


def test_sft_needs_its_data(tiny_kit):
    # an existing model: a missing --hf-checkpoint path is refused first (slime.preflight)
    result = subprocess.run([SLIME, "sft", "--hf-checkpoint", str(tiny_kit.model_dir), "--save", "y"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "stage 'sft' needs: sft.sft_data (--sft-data)" in result.stderr


def run_sft(*flags: str) -> dict:
    result = subprocess.run([SLIME, "sft", *flags], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


def stopped_copy(whole: Path, cut: Path, step: int) -> None:
    """`cut` as the --save of a run that stopped right after its step-`step` save: that checkpoint, and the
    record of an SFT started with the same settings (slime/stages/record.py)."""
    cut.mkdir()
    shutil.copytree(whole / f"iter_{step:07d}", cut / f"iter_{step:07d}")
    record = json.loads(Path(f"{whole}.stage.json").read_text())
    Path(f"{cut}.stage.json").write_text(json.dumps({**record, "status": "started", "result": None}))


def model_weights(checkpoint: Path) -> dict:
    """The model tensors of a torch_dist checkpoint, read with torch's own DCP reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint / "model", checkpoint.parent / "weights.pt")
    state = torch.load(checkpoint.parent / "weights.pt", weights_only=True)
    (checkpoint.parent / "weights.pt").unlink()
    return {k: v for k, v in state.items() if "_extra_state" not in k}


def test_interrupted_sft_resumes_to_the_same_weights(tiny_kit, tmp_path):
    # 32 conversations, 16 per step, 2 epochs: 4 steps; warmup + cosine over them; a save after step 3
    flags = ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:32]",
             "--global-batch-size", "16", "--micro-batch-size", "16", "--lr", "3e-3", "--sft-num-epoch", "2",
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--sft-save-interval", "3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    uninterrupted = run_sft(*flags, "--save", str(whole))
    assert uninterrupted["steps"] == 4 and uninterrupted["resumed_from"] is None
    assert sorted(p.name for p in whole.iterdir()) == ["iter_0000003", "iter_0000004"]
    stopped_copy(whole, cut, 3)  # a run that stopped right after its step-3 save
    resumed = run_sft(*flags, "--save", str(cut))
    assert resumed["resumed_from"] == str(cut / "iter_0000003")
    final_whole, final_cut = model_weights(whole / "iter_0000004"), model_weights(cut / "iter_0000004")
    assert final_whole.keys() == final_cut.keys() and len(final_whole) > 5
    for name, tensor in final_whole.items():
        assert torch.equal(tensor, final_cut[name]), name
    # the loss curve continues where it stopped, and equals the uninterrupted one
    manifest = json.loads((cut / "iter_0000004" / "manifest.json").read_text())
    assert manifest["metadata"]["sft_losses"] == json.loads(
        (whole / "iter_0000004" / "manifest.json").read_text())["metadata"]["sft_losses"]
    # run again on a finished --save: nothing to train, the same checkpoint (its record says so)
    again = run_sft(*flags, "--save", str(cut))
    assert again["reused"] is True and again["record"] == f"{cut}.stage.json"
    assert again["artifacts"]["checkpoint"] == {"uri": resumed["checkpoint"], "manifest_hash": resumed["manifest_hash"]}


def test_sft_refuses_to_continue_with_other_data(tiny_kit, tmp_path):
    flags = ["--hf-checkpoint", str(tiny_kit.model_dir), "--micro-batch-size", "8", "--lr", "3e-3",
             "--save", str(tmp_path / "s"), "--sft-save-interval", "1"]
    run_sft(*flags, "--sft-data", f"{tiny_kit.sft}@[0:8]", "--global-batch-size", "8")
    result = subprocess.run([SLIME, "sft", *flags, "--sft-data", f"{tiny_kit.sft}@[0:16]", "--global-batch-size", "8"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"input sft_data: other content ({tiny_kit.sft}@[0:8] -> {tiny_kit.sft}@[0:16])" in result.stderr
    assert "--overwrite" in result.stderr and (tmp_path / "s" / "iter_0000001").is_dir()


def test_sft_with_no_save_optim_cannot_resume_mid_way(tiny_kit, tmp_path):
    flags = ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", f"{tiny_kit.sft}@[0:16]",
             "--global-batch-size", "8", "--micro-batch-size", "8", "--lr", "3e-3", "--sft-save-interval", "1",
             "--no-save-optim"]
    done = run_sft(*flags, "--save", str(tmp_path / "whole"))
    manifest = json.loads((tmp_path / "whole" / "iter_0000001" / "manifest.json").read_text())
    assert manifest["metadata"]["training_state"] is False
    assert not (tmp_path / "whole" / "iter_0000001" / "optimizer").exists()
    # a finished SFT is not trained again, even from model-only checkpoints
    again = run_sft(*flags, "--save", str(tmp_path / "whole"))
    assert again["reused"] is True and again["artifacts"]["checkpoint"]["manifest_hash"] == done["manifest_hash"]
    stopped_copy(tmp_path / "whole", tmp_path / "cut", 1)
    result = subprocess.run([SLIME, "sft", *flags, "--save", str(tmp_path / "cut")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds the model only (saved with --no-save-optim" in result.stderr
