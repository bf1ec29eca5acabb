"""Rejection sampling: the acceptance rules on hand-made groups, and the stage end to end on the tiny kit
(built-in engine behind the real sglang-router)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import uuid
from argparse import Namespace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slime.config import load_config
from slime.data.sft import load_sft_samples
from slime.errors import ConfigError, DataFormatError
from slime.stages.rejection_sampling import run_rejection_sampling, select_accepted
from slime.storage import read_manifest, read_samples, write_samples
from slime.types import Sample, Status

ARGS = Namespace(reward_key=None)


def sample(index: int, response: list[int], reward: float | None, status: Status = Status.COMPLETED) -> Sample:
    return Sample(index=index, group_index=index // 10, tokens=[7, 7, *response], response_length=len(response),
                  loss_mask=[1] * len(response), reward=reward, status=status)


def test_selection_threshold_dedup_best_of_n():
    groups = [
        [sample(0, [1], 0.0), sample(1, [2], 1.0), sample(2, [2], 1.0), sample(3, [3], 0.5), sample(4, [4], 1.0)],
        [sample(10, [1], 0.0), sample(11, [2], None, Status.FAILED), sample(12, [5], 1.0, Status.TRUNCATED),
         sample(13, [], 1.0)],
        [sample(20, [9], None, Status.ABORTED)],
    ]
    accepted, stats = select_accepted(ARGS, groups, threshold=0.5, best_of_n=2, dedup=True, keep_truncated=False)
    # group 0: 0 below threshold; 1, 2, 4 score 1.0 (2 duplicates 1); best 2 of {1, 4, 3} by reward: 1, 4
    assert [s.index for s in accepted] == [1, 4]
    assert stats == {
        "prompts": 3, "samples": 10, "accepted": 2, "acceptance_rate": 0.2, "prompts_with_accepted": 1,
        "mean_reward": pytest.approx((0 + 1 + 1 + 0.5 + 1 + 0 + 1) / 7),
        "rejected_truncated": 1, "rejected_aborted": 1, "rejected_failed": 1, "rejected_empty": 1,
        "rejected_threshold": 2, "rejected_duplicate": 1, "rejected_best_of_n": 1,
    }
    assert stats["samples"] == stats["accepted"] + sum(v for k, v in stats.items() if k.startswith("rejected_"))


def test_selection_without_threshold_keeps_truncated_and_duplicates_when_asked():
    groups = [[sample(0, [1], 0.0), sample(1, [1], 0.0), sample(2, [5], -1.0, Status.TRUNCATED)]]
    accepted, stats = select_accepted(ARGS, groups, threshold=None, best_of_n=None, dedup=False, keep_truncated=True)
    assert [s.index for s in accepted] == [0, 1, 2]
    assert stats["accepted"] == 3 and stats["rejected_truncated"] == 0 and stats["rejected_duplicate"] == 0


def test_selection_uses_reward_key_for_dict_rewards():
    groups = [[sample(0, [1], None), sample(1, [2], None)]]
    groups[0][0].reward, groups[0][1].reward = {"score": -1.0}, {"score": 1.0}
    accepted, stats = select_accepted(Namespace(reward_key="score"), groups, threshold=0.0, best_of_n=None,
                                      dedup=True, keep_truncated=False)
    assert [s.index for s in accepted] == [1] and stats["rejected_threshold"] == 1


def test_sft_loader_reads_shard_sets_and_rejects_untrainable_ones(tmp_path):
    good = [sample(0, [1, 2], 1.0)]
    write_samples(str(tmp_path / "good"), good)
    assert [s.tokens for s in load_sft_samples(str(tmp_path / "good"), tokenizer=None)] == [[7, 7, 1, 2]]
    bad = [sample(0, [1, 2], 1.0)]
    bad[0].loss_mask = [0, 0]
    write_samples(str(tmp_path / "bad"), bad)
    with pytest.raises(DataFormatError, match=r"bad row 0 \(sample index 0\): no response tokens"):
        load_sft_samples(str(tmp_path / "bad"), tokenizer=None)


# ----------------------------------------------------------------------------- end to end


@pytest.fixture
def rm_module(tmp_path, monkeypatch):
    """A custom reward that spreads: response length mod 4 (the untrained model's lengths are random)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"rs_rm_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        async def length_mod_4(args, sample):
            return float(sample.response_length % 4)
    """))
    return name


def rs_config(tiny_kit, store, *extra):
    return load_config("deployments/tiny-cpu.yaml", [
        "--store", str(store), "--run-id", "rs", "--hf-checkpoint", str(tiny_kit.model_dir),
        "--rs-prompt-data", f"{tiny_kit.train}@[0:6]", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "6", "--rollout-batch-size", "16", *extra])


def expected_selection(candidates, n, threshold, best_of_n):
    """Recompute the accepted set from the candidates, rule by rule."""
    out = []
    for g in range(len(candidates) // n):
        group = [s for s in candidates if s.group_index == g]
        ok = [s for s in group if s.status is Status.COMPLETED and s.response_length > 0 and s.reward >= threshold]
        ok.sort(key=lambda s: (-s.reward, s.index))
        unique, seen = [], set()
        for s in ok:
            key = tuple(s.tokens[-s.response_length:])
            if key not in seen:
                seen.add(key)
                unique.append(s)
        out += unique[:best_of_n]
    return out


def test_rejection_sampling_end_to_end(tiny_kit, tmp_path, rm_module):
    # the digits (ids 48-57) stop generation: about a third of the 16-token responses finish early
    digits = [str(i) for i in range(48, 58)]
    config = rs_config(tiny_kit, tmp_path / "store", "--custom-rm-path", f"{rm_module}.length_mod_4",
                       "--rs-reward-threshold", "1", "--rs-best-of-n", "2", "--rollout-max-response-len", "16",
                       "--rollout-stop-token-ids", *digits)
    result = run_rejection_sampling(config)
    out = tmp_path / "store" / "rs" / "rejection_sampling" / "accepted"
    assert result["output"] == str(out) and result["reused"] is False

    candidates = read_samples(result["candidates"])
    assert len(candidates) == 24 and sorted(s.index for s in candidates) == list(range(24))
    assert sorted({s.group_index for s in candidates}) == list(range(6))
    prompts = [json.loads(line) for line in tiny_kit.train.read_text().splitlines()[:6]]
    stops = set(range(48, 58)) | {AutoTokenizer.from_pretrained(tiny_kit.model_dir).convert_tokens_to_ids("<|im_end|>")}
    for s in candidates:
        assert s.label == prompts[s.group_index]["label"]
        assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.metadata
        assert 0 < s.response_length <= 16 and s.loss_mask == [1] * s.response_length
        assert s.reward == s.response_length % 4  # every sample was scored by the plugin
        assert (s.status is Status.COMPLETED) == (s.tokens[-1] in stops), s  # a digit or EOS ended it
    statuses = {s.status for s in candidates}
    assert statuses == {Status.COMPLETED, Status.TRUNCATED}, statuses

    want = expected_selection(candidates, 4, threshold=1, best_of_n=2)
    accepted = read_samples(str(out))
    assert [(s.index, s.tokens, s.reward) for s in accepted] == [(s.index, s.tokens, s.reward) for s in want]
    assert accepted, "the threshold should accept some samples"
    truncated = sum(s.status is Status.TRUNCATED for s in candidates)
    assert result["accepted"] == len(want) and result["samples"] == 24 and result["prompts"] == 6
    assert result["rejected_truncated"] == truncated
    assert result["prompts_with_accepted"] == len({s.group_index for s in want})
    assert result["samples"] == result["accepted"] + sum(v for k, v in result.items() if k.startswith("rejected_"))
    assert result["generate_errors"] == 0 and result["reward_errors"] == 0
    assert read_manifest(str(out)).metadata["summary"] == {k: v for k, v in result.items()
                                                           if k not in ("output", "candidates", "reused")}

    # the SFT stage's loader reads the accepted set: response tokens masked in, prompt tokens out
    sft = load_sft_samples(str(out), tokenizer=None)
    assert [s.tokens for s in sft] == [s.tokens for s in accepted]
    assert all(sum(s.loss_mask) == s.response_length for s in sft)

    # same config again: the committed output is reused, no engine is started
    again = run_rejection_sampling(config)
    assert again["reused"] is True and again["accepted"] == result["accepted"]
    changed = rs_config(tiny_kit, tmp_path / "store", "--custom-rm-path", f"{rm_module}.length_mod_4",
                        "--rs-reward-threshold", "2")
    with pytest.raises(ConfigError, match="already committed by a different rejection-sampling config"):
        run_rejection_sampling(changed)


def test_rejection_sampling_greedy_duplicates_and_engine_errors(tiny_kit, tmp_path):
    """Greedy decoding makes the 4 samples of a prompt identical: dedup keeps one. A prompt longer than the
    model's context is refused by the engine (HTTP 400): its samples are FAILED and counted, not lost."""
    rows = tiny_kit.train.read_text().splitlines()[:6]
    rows.append(json.dumps({"prompt": "1+" * 300 + "1=", "label": "301"}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(rows) + "\n")
    config = rs_config(tiny_kit, tmp_path / "store", "--rs-prompt-data", str(prompts), "--rollout-top-k", "1",
                       "--rs-reward-threshold", "0", "--rs-keep-truncated", "--rs-output-name", "greedy")
    result = run_rejection_sampling(config)
    candidates = read_samples(result["candidates"])
    assert len(candidates) == 28
    for g in range(6):
        assert len({tuple(s.tokens) for s in candidates if s.group_index == g}) == 1
    failed = [s for s in candidates if s.group_index == 6]
    assert all(s.status is Status.FAILED and s.reward is None for s in failed)
    assert all("returned HTTP 400" in s.metadata["generate_error"] and "maximum context length" in
               s.metadata["generate_error"] for s in failed)
    assert (result["prompts"], result["samples"], result["accepted"]) == (7, 28, 6)
    assert (result["rejected_duplicate"], result["rejected_failed"], result["generate_errors"]) == (18, 4, 4)
    assert [s.group_index for s in read_samples(result["output"])] == list(range(6))


def test_rejection_sampling_config_errors(tiny_kit, tmp_path):
    with pytest.raises(ConfigError, match="unknown reward type 'mth'"):
        run_rejection_sampling(rs_config(tiny_kit, tmp_path, "--rm-type", "mth"))
    with pytest.raises(ConfigError, match="needs a policy"):
        run_rejection_sampling(load_config(overrides=["--store", str(tmp_path), "--run-id", "x",
                                                      "--rs-prompt-data", str(tiny_kit.train), "--rm-type", "math"]))
    with pytest.raises(ConfigError, match="needs prompts"):
        run_rejection_sampling(load_config(overrides=["--store", str(tmp_path), "--run-id", "x"]))


@pytest.mark.slow  # three CLI stages in subprocesses: about 3.5 min on the shared 2-core machine
def test_cli_samples_a_megatron_checkpoint_and_sft_trains_on_the_result(tiny_kit, tmp_path):
    """`slime convert` -> `slime rejection-sample --rs-policy <megatron checkpoint>` (exported to HF on the
    way) -> `slime sft --sft-data <accepted shard set>`."""
    slime = shutil.which("slime", path=str(Path(sys.executable).parent))

    def run(*argv):
        result = subprocess.run([slime, *argv], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout[result.stdout.index("{"):])

    run("convert", "--hf-checkpoint", str(tiny_kit.model_dir), "--save", str(tmp_path / "convert"))
    summary = run("rejection-sample", "--store", str(tmp_path / "store"), "--run-id", "cli",
                  "--hf-checkpoint", str(tiny_kit.model_dir), "--rs-policy", str(tmp_path / "convert"),
                  "--rs-prompt-data", f"{tiny_kit.train}@[0:4]", "--apply-chat-template", "--rm-type", "math_verify",
                  "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--rs-reward-threshold", "0",
                  "--rs-keep-truncated", "--rs-dedup", "false")
    stage = tmp_path / "store" / "cli" / "rejection_sampling"
    export = read_manifest(str(stage / "policy-hf"))
    assert export.kind == "hf_model" and export.metadata["source_checkpoint"].startswith(str(tmp_path / "convert"))
    # rewards >= 0, truncated kept, no dedup: every sample is accepted
    assert summary["samples"] == 8 and summary["accepted"] == 8 and summary["prompts_with_accepted"] == 4
    accepted = read_samples(str(stage / "accepted"))
    assert all(s.reward in (0.0, 1.0) and s.response_length > 0 for s in accepted)

    sft = run("sft", "--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", str(stage / "accepted"),
              "--save", str(tmp_path / "sft"), "--global-batch-size", "8", "--micro-batch-size", "4")
    assert sft["steps"] == 1 and sft["first_loss"] > 0
