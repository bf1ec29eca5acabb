"""Bit-exact resume (fp32, CPU, Adam with warmup + cosine): steps 1..4 with a save after step 2, against a
fresh process that loads step 2 and takes steps 3 and 4. Weights, optimizer state, learning rate and the
next random draws (python, numpy, torch) must be identical, on one rank with the standard optimizer and
on two data-parallel ranks (gloo) with the DistributedOptimizer. Then the refusals and model-only loads.
"""

import hashlib
import json
from pathlib import Path

import pytest
from multirank import run_ranks

SCRIPT = Path(__file__).with_name("checkpoint_resume.py")
SAVE_AT = 2


def run_and_resume(hf_dir: Path, save: Path, world: int, *extra: str) -> tuple[list, list]:
    run = run_ranks(SCRIPT, world, ["run", str(hf_dir), str(save), *extra], timeout=600)
    resume = run_ranks(SCRIPT, world, ["resume", str(hf_dir), str(save), *extra], timeout=600)
    return run, resume


def assert_bit_exact(run: list, resume: list) -> None:
    for rank, (run_rows, resume_rows) in enumerate(zip(run, resume, strict=True)):
        uninterrupted = {row["step"]: row for row in run_rows}
        assert [row["step"] for row in resume_rows] == [SAVE_AT, SAVE_AT + 1, SAVE_AT + 2]
        for row in resume_rows:
            expected = uninterrupted[row["step"]]
            for key in ("weights", "expert_bias", "optimizer", "lr", "draws"):
                assert row[key] == expected[key], (rank, row["step"], key)
        # the steps after the save really train: weights, optimizer state and lr all move
        after = [uninterrupted[k] for k in (SAVE_AT, SAVE_AT + 1, SAVE_AT + 2)]
        assert len({r["weights"] for r in after}) == 3 and len({r["optimizer"] for r in after}) == 3
        assert len({r["lr"] for r in after}) == 3  # peak after warmup, then cosine decay
        assert resume_rows[0]["extra_state"] == {"cursor": 8, "buffer": [[1, 2], [3]]}
        assert resume_rows[0]["iteration"] == SAVE_AT


@pytest.fixture(scope="module")
def one_rank(tiny_kit, tmp_path_factory):
    save = tmp_path_factory.mktemp("resume-1")
    run, resume = run_and_resume(tiny_kit.model_dir, save, 1)
    return save, run, resume


def test_one_rank_resume_is_bit_exact(one_rank):
    _, run, resume = one_rank
    assert_bit_exact(run, resume)
    assert not any(row["fused"] for rows in (*run, *resume) for row in rows)  # CPU default: torch's for-loop Adam


@pytest.mark.parametrize("sharding", ["dp_reshardable", pytest.param("fully_reshardable", marks=pytest.mark.slow)])
def test_two_ranks_distributed_optimizer_resume_is_bit_exact(tiny_kit, tmp_path, sharding):
    run, resume = run_and_resume(tiny_kit.model_dir, tmp_path, 2, "--distributed", sharding)
    assert_bit_exact(run, resume)
    # each rank holds its own shard of the optimizer state, and its own RNG streams
    assert run[0][-1]["optimizer"] != run[1][-1]["optimizer"]
    assert run[0][-1]["draws"][:2] != run[1][-1]["draws"][:2]
    manifest = json.loads((tmp_path / "full" / f"iter_{SAVE_AT:07d}" / "manifest.json").read_text())
    assert manifest["metadata"]["optimizer_sharding"] == sharding
    assert manifest["metadata"]["parallel"]["data_parallel_size"] == 2
    assert manifest["metadata"]["parallel"]["use_distributed_optimizer"] is True


@pytest.mark.slow  # 35 s; its two halves run by default: fused Adam resume (one rank) and dp_reshardable (two ranks)
def test_two_ranks_distributed_optimizer_resume_with_fused_adam_is_bit_exact(tiny_kit, tmp_path):
    run, resume = run_and_resume(tiny_kit.model_dir, tmp_path, 2, "--distributed", "dp_reshardable", "--fused-adam")
    assert_bit_exact(run, resume)
    assert all(row["fused"] for rows in (*run, *resume) for row in rows)


def test_one_rank_resume_with_fused_adam_is_bit_exact(tiny_kit, tmp_path):
    """train.fused_adam: torch's fused AdamW kernel (its `step` tensors live on the parameters' device) saves
    and resumes bit-exactly too, and stays the kernel after the load."""
    run, resume = run_and_resume(tiny_kit.model_dir, tmp_path, 1, "--fused-adam")
    assert_bit_exact(run, resume)
    assert all(row["fused"] for rows in (*run, *resume) for row in rows)


EMPTY = hashlib.sha256().hexdigest()  # the digest of an optimizer with no state: fresh, never stepped


def test_no_load_optim_keeps_weights_iteration_and_rng_with_a_fresh_optimizer_and_schedule(one_rank, tiny_kit):
    """Megatron's --no-load-optim: the optimizer and LR schedule start afresh (Megatron-LM loads the schedule only
    with the optimizer), everything else is the checkpoint's."""
    save, run, _ = one_rank
    (rows,) = run_ranks(SCRIPT, 1, ["resume", str(tiny_kit.model_dir), str(save), "--no-load-optim"], timeout=600)
    saved = next(row for row in run[0] if row["step"] == SAVE_AT)
    loaded = rows[0]
    assert loaded["weights"] == saved["weights"] and loaded["draws"] == saved["draws"]
    assert loaded["iteration"] == SAVE_AT and loaded["extra_state"] == {"cursor": 8, "buffer": [[1, 2], [3]]}
    assert saved["optimizer"] != EMPTY and loaded["optimizer"] == EMPTY
    assert loaded["lr"] == pytest.approx(1e-4) != saved["lr"]  # the warmup's first lr (lr_warmup_init), again
    # the first step after the load trains from the loaded weights with fresh Adam moments: not the run's step
    assert rows[1]["weights"] != next(row for row in run[0] if row["step"] == SAVE_AT + 1)["weights"]


def test_no_load_rng_keeps_the_optimizer_and_leaves_the_generators(one_rank, tiny_kit):
    save, run, _ = one_rank
    (rows,) = run_ranks(SCRIPT, 1, ["resume", str(tiny_kit.model_dir), str(save), "--no-load-rng"], timeout=600)
    saved = next(row for row in run[0] if row["step"] == SAVE_AT)
    loaded = rows[0]
    assert (loaded["weights"], loaded["optimizer"], loaded["lr"]) == (saved["weights"], saved["optimizer"], saved["lr"])
    assert loaded["draws"] != saved["draws"]  # the generators are the fresh process's, not the saved ones


@pytest.fixture(scope="module")
def refusals(one_rank, tiny_kit, tmp_path_factory):
    save, run, _ = one_rank
    other = tmp_path_factory.mktemp("one-layer")  # the kit's config with 1 layer instead of 4: no weights needed
    config = json.loads((tiny_kit.model_dir / "config.json").read_text())
    config.update(num_hidden_layers=1, layer_types=config.get("layer_types", [None])[:1])
    (other / "config.json").write_text(json.dumps(config))
    (rows,) = run_ranks(SCRIPT, 1, ["checks", str(tiny_kit.model_dir), str(save), str(other)], timeout=600)
    return {row["check"]: row for row in rows}, run[0]


def test_model_only_checkpoint_loads_weights_and_refuses_full_resume(refusals):
    checks, run_rows = refusals
    saved_weights = next(r["weights"] for r in run_rows if r["step"] == SAVE_AT)
    assert checks["model-only load"]["weights"] == saved_weights
    refused = checks["full resume of a model-only checkpoint"]
    assert refused["error"] == "ModelOnlyCheckpointError" and refused["is_config_error"]
    assert "--no-save-optim" in refused["message"] and "model-only" in refused["message"]


def test_other_architecture_is_refused_naming_the_field(refusals):
    refused = refusals[0]["other architecture"]
    assert refused["error"] == "CheckpointMismatchError" and refused["is_config_error"]
    assert "num_layers is 4 in the checkpoint but 1 in the model" in refused["message"]


def test_other_schedule_is_refused_naming_the_field(refusals):
    refused = refusals[0]["resume with another lr"]
    assert refused["error"] == "CheckpointMismatchError"
    assert "max_lr is 0.01 in the checkpoint but 0.005 now (from train.lr)" in refused["message"]


@pytest.fixture(scope="module")
def lora_runs(tiny_kit, tmp_path_factory):
    save = tmp_path_factory.mktemp("resume-lora")
    run, resume = run_and_resume(tiny_kit.model_dir, save, 1, "--lora")
    return save, run, resume


def test_lora_resume_is_bit_exact_and_saves_the_adapters_only(lora_runs, tiny_kit):
    save, run, resume = lora_runs
    assert_bit_exact(run, resume)  # adapter weights, their Adam state, lr and RNG (dropout 0.1 draws from it)
    path = save / "full" / f"iter_{SAVE_AT:07d}"
    meta = json.loads((path / "manifest.json").read_text())["metadata"]
    assert meta["lora"]["rank"] == 4 and meta["lora"]["targets"] == ["linear_qkv", "linear_fc2"]
    assert meta["lora"]["base"]["source"] == str(tiny_kit.model_dir) and len(meta["lora"]["base"]["sha256"]) == 64
    model_bytes = sum(f.stat().st_size for f in (path / "model").rglob("*") if f.is_file())
    hf_bytes = sum(f.stat().st_size for f in tiny_kit.model_dir.glob("*.safetensors"))
    assert model_bytes < hf_bytes / 10  # adapters only, no base weight


def test_lora_checkpoint_refuses_another_base_and_a_model_without_adapters(lora_runs, tiny_kit, tmp_path):
    save, _, _ = lora_runs
    other = tmp_path / "other-base"
    other.mkdir()
    config = json.loads((tiny_kit.model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    (rows,) = run_ranks(SCRIPT, 1, ["checks", str(tiny_kit.model_dir), str(save), str(other), "--lora"], timeout=600)
    checks = {row["check"]: row for row in rows}
    assert checks["same base"]["error"] is None
    assert checks["other base"]["error"] == "CheckpointMismatchError"
    assert "trained on base" in checks["other base"]["message"] and str(other) in checks["other base"]["message"]
    assert checks["model without adapters"]["error"] == "CheckpointMismatchError"
    assert "lora is" in checks["model without adapters"]["message"]
