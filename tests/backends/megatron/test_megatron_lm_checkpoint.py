"""Checkpoints both ways between this project and Megatron-LM / slime (`--ckpt-format torch_dist`).

A checkpoint written the way Megatron-LM writes it (megatron_lm_ckpt.write_like_megatron_lm: its state-dict layout
through megatron-core's dist_checkpointing.save, the tracker file, slime's data-cursor file) loads here through
`--load`'s path (`resolve_checkpoint` + `load_checkpoint`) and the next steps equal the uninterrupted run's
bit for bit (fp32, CPU: weights, Adam state, lr, loss, python/numpy/torch draws). One written here in that layout
(`save_megatron_lm_checkpoint`) has the same torch_dist keys and common.pt entries and reloads the same way. TP 2
written, TP 1 loaded: the same weights as this project's own TP 2 checkpoint resharded. Then the refusals.
"""

import io
import pickle
from pathlib import Path

import pytest
from multirank import run_ranks

from slime.errors import CheckpointError, MegatronLMCheckpointError

SCRIPT = Path(__file__).with_name("megatron_lm_ckpt.py")
SAVE_AT = 2


@pytest.fixture(scope="module")
def tp1(tiny_kit, tmp_path_factory):
    save = tmp_path_factory.mktemp("mlm-tp1")
    (run,) = run_ranks(SCRIPT, 1, ["run", str(tiny_kit.model_dir), str(save)], timeout=600)
    (resume,) = run_ranks(SCRIPT, 1, ["resume", str(tiny_kit.model_dir), str(save)], timeout=600)
    return save, run, resume


def test_megatron_lm_layout_written_here_matches_megatron_lms(tp1):
    """The key layout Megatron-LM writes (its model and optimizer ShardedTensors without a prefix, rng_state as one
    object per (PP, TP) rank; args, iteration, checkpoint_version 3.0, opt_param_scheduler, the optimizer's
    param_groups and content_metadata in common.pt) is the one written here."""
    _, run, _ = tp1
    layouts = {row["layout"]: row for row in run if "layout" in row}
    theirs, ours = layouts["mlm"], layouts["ours_mlm"]
    assert ours["keys"] == theirs["keys"]
    assert {"embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight", "rng_state/shard_0.0_1.1"} <= set(ours["keys"])
    assert ours["common"] == theirs["common"] == ["checkpoint_version", "content_metadata", "iteration",
                                                  "num_floating_point_operations_so_far", "opt_param_scheduler",
                                                  "optimizer"]
    assert ours["content_metadata"] == theirs["content_metadata"]
    assert ours["checkpoint_version"] == 3.0 and ours["iteration"] == SAVE_AT and not ours["unread"]
    # what Megatron-LM's load_checkpoint / check_checkpoint_args read from args
    assert {"num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size",
            "pipeline_model_parallel_size", "no_save_optim", "no_save_rng"} <= set(ours["args"])
    # args classes outside the weights-only allowlist are left unread, not unpickled
    assert theirs["unread"] == ["__main__.SlimeOnlyThing", "fractions.Fraction"]


@pytest.mark.parametrize("which", ["mlm", "ours_mlm"])
def test_loading_a_megatron_lm_checkpoint_continues_training_bit_exactly(tp1, which):
    _, run, resume = tp1
    uninterrupted = {row["step"]: row for row in run if "step" in row}
    rows = [row for row in resume if row["where"] == which]
    assert [row["step"] for row in rows] == [SAVE_AT, SAVE_AT + 1, SAVE_AT + 2]
    for row in rows:
        for key in ("weights", "optimizer", "lr", "draws"):
            assert row[key] == uninterrupted[row["step"]][key], (which, row["step"], key)
    for row in rows[1:]:
        assert row["loss"] == uninterrupted[row["step"]]["loss"]
    assert rows[0]["iteration"] == SAVE_AT
    expected_cursor = {"epoch_id": 0, "sample_offset": 8, "sample_group_index": 8, "sample_index": 64}
    assert rows[0]["extra_state"] == ({"slime_data_source": expected_cursor} if which == "mlm" else {})


@pytest.mark.slow  # three rank processes: 35 s on a quiet machine, 85 s loaded (2026-11-28, passed)
def test_tensor_parallel_2_checkpoint_loads_at_tp_1(tiny_kit, tmp_path):
    run_ranks(SCRIPT, 2, ["run", str(tiny_kit.model_dir), str(tmp_path)], timeout=600)
    (rows,) = run_ranks(SCRIPT, 1, ["reshard", str(tiny_kit.model_dir), str(tmp_path)], timeout=600)
    assert rows[0]["mlm"] == rows[0]["native"]  # the same weights as this project's TP 2 checkpoint, resharded
    assert rows[1]["weights"] == rows[0]["native"] and rows[1]["iteration"] == SAVE_AT
    assert rows[1]["optimizer"] != "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # Adam state loaded


def test_tracker_naming_a_missing_iteration_is_refused_naming_the_file(tmp_path):
    from slime.backends.megatron.checkpoint import resolve_checkpoint

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40\n")
    (tmp_path / "iter_0000020").mkdir()
    with pytest.raises(MegatronLMCheckpointError, match="latest_checkpointed_iteration.txt names iteration 40") as exc:
        resolve_checkpoint(str(tmp_path))
    assert str(tmp_path / "iter_0000040") in str(exc.value) and isinstance(exc.value, CheckpointError)


def test_legacy_torch_format_is_refused_with_the_conversion_command(tmp_path):
    from slime.backends.megatron.checkpoint import resolve_checkpoint

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    (tmp_path / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    with pytest.raises(MegatronLMCheckpointError, match="legacy torch format") as exc:
        resolve_checkpoint(str(tmp_path))
    assert "--ckpt-convert-format torch_dist --ckpt-convert-save" in str(exc.value)


class _Exploit:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled')",))


def test_common_pt_is_read_weights_only_and_never_runs_a_pickled_callable(tmp_path):
    """An args field whose pickle would call `exec` becomes an inert UnreadArg: nothing of it runs."""
    import torch

    from slime.backends.megatron.megatron_lm import UnreadArg, _weights_only_load

    buf = io.BytesIO()
    torch.save({"args": __import__("argparse").Namespace(num_layers=4, evil=_Exploit()), "iteration": 3}, buf)
    loaded, unread = _weights_only_load(io.BytesIO(buf.getvalue()))
    assert unread == ["builtins.exec"] and loaded["iteration"] == 3
    assert loaded["args"].num_layers == 4 and isinstance(loaded["args"].evil, UnreadArg)
    with pytest.raises(SystemExit):  # what a plain unpickle would have done
        pickle.loads(pickle.dumps(_Exploit()))


def test_export_megatron_lm_layout_writes_what_the_library_writes(tp1, tiny_kit, tmp_path):
    """`slime export --megatron-lm-layout` of this project's one-rank full checkpoint: the tracker, the same
    torch_dist keys as `save_megatron_lm_checkpoint`, and its schedule in Megatron's sample counts."""
    import json
    import shutil
    import subprocess
    import sys

    from torch.distributed.checkpoint import FileSystemReader

    from slime.backends.megatron.megatron_lm import read_megatron_lm_checkpoint

    save, run, _ = tp1
    out = tmp_path / "mlm"
    slime = shutil.which("slime", path=str(Path(sys.executable).parent))
    result = subprocess.run([slime, "export", "--load", str(save / "native"), "--output-dir", str(out),
                             "--megatron-lm-layout", "--origin-hf-dir", str(tiny_kit.model_dir),
                             "--global-batch-size", "4"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout[result.stdout.index("{"):])["megatron_lm_dir"] == str(out)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == str(SAVE_AT)
    path = out / f"iter_{SAVE_AT:07d}"
    ours = {row["layout"]: row for row in run if "layout" in row}["ours_mlm"]
    assert sorted(FileSystemReader(str(path)).read_metadata().state_dict_metadata) == ours["keys"]
    ckpt = read_megatron_lm_checkpoint(str(path))
    assert ckpt.common["opt_param_scheduler"]["num_steps"] == SAVE_AT * 4 and ckpt.arg("global_batch_size") == 4
    assert ckpt.iteration == SAVE_AT and not ckpt.arg("no_save_optim") and not ckpt.arg("no_save_rng")
