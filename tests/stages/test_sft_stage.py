"""`slime sft` end to end on the tiny kit (CPU): loss falls, the checkpoint is committed and exports; an
interrupted SFT resumes from its newest checkpoint to the weights of an uninterrupted one.

Each `slime sft` is a process of its own, mostly imports and set-up on one core: the first SFT of each test
(the one the test goes on from) runs in one module fixture, two at a time, which on two cores takes well under
twice the time of one."""

import json
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

SLIME = shutil.which("slime", path=str(Path(sys.executable).parent))


def run_sft(*flags: str) -> dict:
    result = subprocess.run([SLIME, "sft", *flags], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


def lowers_loss_flags(kit) -> list[str]:
    return ["--hf-checkpoint", str(kit.model_dir), "--sft-data", f"{kit.sft}@[0:256]", "--global-batch-size", "64",
            "--micro-batch-size", "32", "--lr", "1e-6", "--sft-lr", "3e-3", "--sft-lr-warmup-iters", "1",
            "--sft-num-epoch", "2"]


def interrupted_flags(kit) -> list[str]:
    # 32 conversations, 16 per step, 2 epochs: 4 steps; warmup + cosine over them; a save after step 3
    return ["--hf-checkpoint", str(kit.model_dir), "--sft-data", f"{kit.sft}@[0:32]", "--global-batch-size", "16",
            "--micro-batch-size", "16", "--lr", "3e-3", "--sft-num-epoch", "2", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--sft-save-interval", "3"]


def other_data_flags(kit) -> list[str]:
    return ["--hf-checkpoint", str(kit.model_dir), "--micro-batch-size", "8", "--lr", "3e-3",
            "--sft-save-interval", "1", "--global-batch-size", "8"]


def no_save_optim_flags(kit) -> list[str]:
    return ["--hf-checkpoint", str(kit.model_dir), "--sft-data", f"{kit.sft}@[0:16]", "--global-batch-size", "8",
            "--micro-batch-size", "8", "--lr", "3e-3", "--sft-save-interval", "1", "--no-save-optim"]


@pytest.fixture(scope="module")
def first_sft(tiny_kit, tmp_path_factory) -> dict[str, tuple[Path, Future]]:
    """Per test below: the --save of its first SFT and that run's summary (a Future: a failed run fails the
    test that reads it, not the others)."""
    saves = {name: tmp_path_factory.mktemp(name) / "save" for name in
             ("lowers_loss", "interrupted", "other_data", "no_save_optim")}
    flags = {"lowers_loss": lowers_loss_flags(tiny_kit), "interrupted": interrupted_flags(tiny_kit),
             "other_data": [*other_data_flags(tiny_kit), "--sft-data", f"{tiny_kit.sft}@[0:8]"],
             "no_save_optim": no_save_optim_flags(tiny_kit)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        return {name: (save, pool.submit(run_sft, *flags[name], "--save", str(save))) for name, save in saves.items()}


def test_sft_lowers_loss_commits_and_exports(first_sft, tmp_path):
    save, run = first_sft["lowers_loss"]
    out = tmp_path / "hf"
    summary = run.result()
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


def test_interrupted_sft_resumes_to_the_same_weights(first_sft, tiny_kit, tmp_path):
    flags = interrupted_flags(tiny_kit)
    whole, run = first_sft["interrupted"]
    cut = tmp_path / "cut"
    uninterrupted = run.result()
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


def test_sft_refuses_to_continue_with_other_data(first_sft, tiny_kit):
    save, run = first_sft["other_data"]
    run.result()  # trained on conversations 0-7
    result = subprocess.run([SLIME, "sft", *other_data_flags(tiny_kit), "--save", str(save),
                             "--sft-data", f"{tiny_kit.sft}@[0:16]"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"input sft_data: other content ({tiny_kit.sft}@[0:8] -> {tiny_kit.sft}@[0:16])" in result.stderr
    assert "--overwrite" in result.stderr and (save / "iter_0000001").is_dir()


def test_sft_with_no_save_optim_cannot_resume_mid_way(first_sft, tiny_kit, tmp_path):
    flags = no_save_optim_flags(tiny_kit)
    whole, run = first_sft["no_save_optim"]
    done = run.result()
    manifest = json.loads((whole / "iter_0000001" / "manifest.json").read_text())
    assert manifest["metadata"]["training_state"] is False
    assert not (whole / "iter_0000001" / "optimizer").exists()
    # a finished SFT is not trained again, even from model-only checkpoints
    again = run_sft(*flags, "--save", str(whole))
    assert again["reused"] is True and again["artifacts"]["checkpoint"]["manifest_hash"] == done["manifest_hash"]
    stopped_copy(whole, tmp_path / "cut", 1)
    result = subprocess.run([SLIME, "sft", *flags, "--save", str(tmp_path / "cut")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds the model only (saved with --no-save-optim" in result.stderr
