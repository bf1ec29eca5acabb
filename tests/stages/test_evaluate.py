"""Stage `evaluate` on the tiny kit: built-in engines behind the real sglang-router evaluate an HF model and
a converted Megatron checkpoint on two datasets; the stored summary is recomputed from the shards; a
committed result is reused, a watched run is skipped when nothing is new, bad input fails early."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import uuid
from collections import defaultdict

import pytest
import yaml

from slime.config import load_config
from slime.errors import ConfigError, DataFormatError, NotCommittedError
from slime.rollout import RolloutFnEvalOutput
from slime.stages.convert import run_convert
from slime.stages.evaluate import plan_evaluate, policy_label, run_evaluate, split_metrics, write_result
from slime.storage import ArtifactStore, read_manifest, read_samples, write_samples
from slime.storage.fs import open_fs
from slime.types import Sample, Status

RM_SOURCE = """
async def last_token_even(args, sample):
    return float(sample.tokens[-1] % 2 == 0)
"""


@pytest.fixture(scope="module")
def setup(tiny_kit, tmp_path_factory):
    """(tmp dir, eval config YAML, reward module dir): two datasets with different n and sampling overrides,
    scored by a reward that splits the untrained model's answers (the parity of the last token)."""
    root = tmp_path_factory.mktemp("evaluate")
    module = f"eval_rm_{uuid.uuid4().hex[:8]}"
    (root / f"{module}.py").write_text(textwrap.dedent(RM_SOURCE))
    eval_yaml = root / "eval.yaml"
    eval_yaml.write_text(yaml.safe_dump({"eval": {
        "defaults": {"n_samples_per_eval_prompt": 4, "custom_rm_path": f"{module}.last_token_even"},
        "datasets": [
            {"name": "arith", "path": f"{tiny_kit.eval}@[0:5]"},
            {"name": "greedy", "path": f"{tiny_kit.eval}@[5:8]", "n_samples_per_eval_prompt": 2,
             "temperature": 0.0, "max_response_len": 3, "metadata_overrides": {"source": "greedy"}},
        ]}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        yield root, eval_yaml


def eval_config(tiny_kit, root, eval_yaml, *extra):
    return load_config(overrides=[
        "--store", str(root / "store"), "--run-id", "evals", "--hf-checkpoint", str(tiny_kit.model_dir),
        "--eval-config", str(eval_yaml), "--eval-temperature", "1.0", "--eval-max-response-len", "5",
        "--rollout-max-response-len", "16", *extra])


@pytest.fixture
def no_engines(monkeypatch):
    """Any engine start fails the test: proves a result was reused, or bad input refused, without serving."""

    def refuse(*args, **kwargs):
        raise AssertionError("an engine fleet was started")

    monkeypatch.setattr("slime.stages.evaluate.serve_policy", refuse)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021, written out: 1 - C(n-c, k) / C(n, k) (the whole set is correct-free only if n-c >= k)."""
    return 1.0 - (math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 0.0)


def expected_metrics(samples, n: int) -> dict:
    """The summary of one dataset recomputed from its stored samples."""
    groups = defaultdict(list)
    for s in samples:
        groups[s.group_index].append(s)
    assert all(len(g) == n for g in groups.values())
    out = {"prompts": len(groups), "samples": len(samples), "failed": 0,
           "mean_reward": statistics.fmean(s.reward for s in samples),
           "truncated_ratio": sum(s.status is Status.TRUNCATED for s in samples) / len(samples),
           "response_len/mean": statistics.fmean(s.response_length for s in samples),
           "response_len/max": max(s.response_length for s in samples)}
    k = 1
    while k <= n:
        out[f"pass@{k}"] = statistics.fmean(pass_at_k(n, sum(s.reward > 0 for s in g), k) for g in groups.values())
        k *= 2
    return out


def read_json(uri: str) -> dict:
    fs, path = open_fs(uri)
    return json.loads(fs.cat_file(path))


def test_evaluate_hf_model_summary_matches_shards_then_reuses(tiny_kit, setup):
    root, eval_yaml = setup
    config = eval_config(tiny_kit, root, eval_yaml)
    result = run_evaluate(config)
    assert result["reused"] is False and result["skipped"] is False
    assert result["result"].startswith(str(root / "store" / "evals" / "evaluate" / "model-"))
    assert set(result["datasets"]) == set(result["metrics"]) == {"arith", "greedy"}
    assert set(result["phases"]) == {"export_s", "engines_s", "eval_s", "commit_s"}
    assert result["eval_seconds"] == result["phases"]["eval_s"] < result["seconds"]

    arith = read_samples(result["datasets"]["arith"])
    greedy = read_samples(result["datasets"]["greedy"])
    assert len(arith) == 20 and len(greedy) == 6  # 5 prompts x 4, 3 prompts x 2
    labels = [json.loads(line)["label"] for line in tiny_kit.eval.read_text().splitlines()[:8]]
    assert [s.label for s in arith] == [labels[s.group_index] for s in arith]
    assert [s.label for s in greedy] == [labels[5 + s.group_index] for s in greedy]
    for s in arith + greedy:  # every sample was scored by the plugin
        assert s.reward == float(s.tokens[-1] % 2 == 0)
    assert max(s.response_length for s in arith) <= 5 and max(s.response_length for s in greedy) <= 3
    assert all(s.metadata["source"] == "greedy" for s in greedy)
    for g in range(3):  # temperature 0 override: both samples of a prompt are the same answer
        assert len({tuple(s.tokens) for s in greedy if s.group_index == g}) == 1
    assert 0 < sum(s.reward for s in arith) < 20, "the reward should split the sampled answers"

    assert result["metrics"]["arith"] == pytest.approx(expected_metrics(arith, 4), rel=1e-12)
    assert result["metrics"]["greedy"] == pytest.approx(expected_metrics(greedy, 2), rel=1e-12)
    assert "pass@4" in result["metrics"]["arith"] and "pass@4" not in result["metrics"]["greedy"]

    summary = read_json(result["summary"])
    assert summary["metrics"] == result["metrics"]
    assert summary["checkpoint"] == str(tiny_kit.model_dir) == result["checkpoint"]
    manifest = read_manifest(result["result"])
    assert manifest.kind == "eval_result" and manifest.metadata["checkpoint"] == str(tiny_kit.model_dir)
    assert manifest.metadata["checkpoint_manifest_hash"] == result["checkpoint_manifest_hash"]
    # the one manifest covers the summary and both shard sets
    assert {f.path.split("/")[0] for f in manifest.files} == {"summary.json", "arith", "greedy"}
    json.dumps(result)  # a Prefect task can return it as JSON

    # same checkpoint, same settings: the committed result comes back, no engine is started
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("slime.stages.evaluate.serve_policy", lambda *a, **k: pytest.fail("engines started for a reuse"))
        again = run_evaluate(eval_config(tiny_kit, root, eval_yaml))
    assert again["reused"] is True and "phases" not in again
    assert {k: again[k] for k in ("result", "manifest_hash", "metrics")} == \
        {k: result[k] for k in ("result", "manifest_hash", "metrics")}
    # ... also through `python -m slime.stages.evaluate`
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    cli = subprocess.run([sys.executable, "-m", "slime.stages.evaluate", "--store", str(root / "store"), "--run-id", "evals",
                          "--hf-checkpoint", str(tiny_kit.model_dir), "--eval-config", str(eval_yaml),
                          "--eval-temperature", "1.0", "--eval-max-response-len", "5",
                          "--rollout-max-response-len", "16"], capture_output=True, text=True, timeout=300, env=env)
    assert cli.returncode == 0, cli.stderr[-3000:]
    printed = json.loads(cli.stdout[cli.stdout.index("{"):])
    assert printed["reused"] is True and printed["result"] == result["result"]


def test_evaluate_converted_checkpoint_watch_mode_skips_and_reuses(tiny_kit, setup, tmp_path):
    """A run's convert checkpoint, found by --eval-watch-run: exported, served and evaluated once; greedy
    answers equal the HF model's (conversion is exact); afterwards the watch skips it."""
    root, eval_yaml = setup
    store = tmp_path / "store"
    watch = ("--store", str(store), "--eval-watch-run", "train")

    nothing = run_evaluate(eval_config(tiny_kit, root, eval_yaml, *watch))
    assert nothing["skipped"] is True and "run 'train' has no committed checkpoint" in nothing["reason"]

    convert = load_config(overrides=["--hf-checkpoint", str(tiny_kit.model_dir),
                                     "--save", str(store / "train" / "convert" / "checkpoint")])
    checkpoint = run_convert(convert)
    first = run_evaluate(eval_config(tiny_kit, root, eval_yaml, *watch))
    assert first["skipped"] is False and first["reused"] is False
    assert first["checkpoint"] == checkpoint["checkpoint"]
    assert first["checkpoint_manifest_hash"] == checkpoint["manifest_hash"]
    assert os.path.basename(first["result"]).startswith("convert-iter_0000000-")
    assert read_manifest(first["result"]).metadata["checkpoint_manifest_hash"] == checkpoint["manifest_hash"]
    greedy = read_samples(first["datasets"]["greedy"])
    assert first["metrics"]["greedy"] == pytest.approx(expected_metrics(greedy, 2), rel=1e-12)
    hf = run_evaluate(eval_config(tiny_kit, root, eval_yaml, "--store", str(store)))  # the HF model, same settings
    assert hf["result"] != first["result"]
    assert [s.tokens for s in read_samples(hf["datasets"]["greedy"])] == [s.tokens for s in greedy]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("slime.stages.evaluate.serve_policy", lambda *a, **k: pytest.fail("engines started for a skip"))
        skipped = run_evaluate(eval_config(tiny_kit, root, eval_yaml, *watch))
        assert skipped["skipped"] is True and "evaluated with this config already" in skipped["reason"]
        assert skipped["result"] == first["result"] and skipped["metrics"] == first["metrics"]
        # --load of the save root names the same checkpoint: the same result, reused
        loaded = run_evaluate(eval_config(tiny_kit, root, eval_yaml, "--store", str(store),
                                          "--load", str(store / "train" / "convert" / "checkpoint")))
        assert loaded["reused"] is True and loaded["result"] == first["result"]


def test_evaluate_refuses_bad_input_before_serving(tiny_kit, setup, tmp_path, no_engines):
    root, eval_yaml = setup
    with pytest.raises(NotCommittedError, match=f"{tmp_path / 'empty'} holds no committed checkpoint"):
        (tmp_path / "empty").mkdir()
        run_evaluate(eval_config(tiny_kit, root, eval_yaml, "--load", str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="evaluate needs a policy"):
        run_evaluate(load_config(overrides=["--run-id", "x", "--eval-config", str(eval_yaml)]))
    with pytest.raises(ConfigError, match="no eval dataset"):
        run_evaluate(load_config(overrides=["--run-id", "x", "--hf-checkpoint", str(tiny_kit.model_dir)]))
    with pytest.raises(ConfigError, match=r"eval dataset 'gone': .*missing\.jsonl: no such file"):
        run_evaluate(eval_config(tiny_kit, root, eval_yaml, "--eval-prompt-data", "gone",
                                 str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": 4\n')
    with pytest.raises(DataFormatError, match=rf"{bad}:2: invalid JSON"):
        run_evaluate(eval_config(tiny_kit, root, eval_yaml, "--eval-prompt-data", "bad", str(bad)))


def test_eval_key_covers_what_the_result_depends_on(tiny_kit, setup, tmp_path):
    """Settings that change the result change the key (a directory of their own); the watch and interval
    fields, which only choose what and when to evaluate, do not."""
    root, eval_yaml = setup
    base = plan_evaluate(eval_config(tiny_kit, root, eval_yaml))
    assert base.uri.startswith(str(root / "store" / "evals" / "evaluate" / "model-")) and base.uri.endswith(base.key[:10])
    same = [("--eval-interval", "3"), ("--eval-watch-stages", "sft"), ("--skip-eval-before-train",)]
    for extra in same:
        assert plan_evaluate(eval_config(tiny_kit, root, eval_yaml, *extra)).key == base.key, extra
    other_yaml = tmp_path / "eval.yaml"
    raw = yaml.safe_load(eval_yaml.read_text())
    raw["eval"]["datasets"][1]["max_response_len"] = 2
    other_yaml.write_text(yaml.safe_dump(raw))
    keys = {plan_evaluate(eval_config(tiny_kit, root, other_yaml)).key}
    for extra in [("--eval-temperature", "0.5"), ("--rollout-max-response-len", "12"), ("--rm-type", "f1"),
                  ("--seed", "7"), ("--n-samples-per-eval-prompt", "3")]:
        keys.add(plan_evaluate(eval_config(tiny_kit, root, eval_yaml, *extra)).key)
    assert len(keys) == 6 and base.key not in keys
    # another policy: another key, even with the same settings
    copy_dir = tmp_path / "model"
    shutil.copytree(tiny_kit.model_dir, copy_dir)
    (copy_dir / "config.json").write_text((copy_dir / "config.json").read_text() + "\n")  # same model, edited
    moved = plan_evaluate(eval_config(tiny_kit, root, eval_yaml, "--hf-checkpoint", str(copy_dir)))
    assert moved.policy_hash != base.policy_hash and moved.key != base.key


def test_labels_and_metric_split():
    assert policy_label("/s/run/sft/checkpoint/iter_0000007") == "sft-iter_0000007"
    assert policy_label("/models/Qwen2.5 0.5B/") == "Qwen2.5-0.5B"
    flat = {"eval/a/pass@1": 0.5, "eval/ab/pass@1": 1.0, "eval/a/samples": 4, "eval/time_s": 2.0}
    assert split_metrics(flat, ["a", "ab"]) == {"a": {"pass@1": 0.5, "samples": 4}, "ab": {"pass@1": 1.0}}


def test_write_result_replaces_the_leftovers_of_a_failed_attempt(tmp_path):
    """An attempt that died after committing one dataset's shard set left no result: the next attempt with
    the same key starts clean, and its manifest lists only its own files."""
    store = ArtifactStore(str(tmp_path / "store"))
    uri = store.uri("r", "evaluate", "model-0123456789")
    write_samples(f"{uri}/a", [Sample(index=0, tokens=[1, 2], response_length=1, reward=0.0)])  # the dead attempt
    (tmp_path / "store" / "r" / "evaluate" / "model-0123456789" / "stray.tmp").write_text("half")
    samples = [Sample(index=i, group_index=i, tokens=[1, 2, 3], response_length=1, reward=1.0) for i in range(2)]
    out = RolloutFnEvalOutput(data={"a": {"samples": samples}})
    meta = {"checkpoint": "ckpt", "metrics": {"a": {"samples": 2}}}
    write_result(store, uri, "k" * 64, out, meta, "r")
    manifest = read_manifest(uri)
    assert manifest.config_hash == "k" * 64 and manifest.metadata == meta
    assert "stray.tmp" not in {f.path for f in manifest.files}
    assert [s.index for s in read_samples(f"{uri}/a")] == [0, 1]
    assert read_json(f"{uri}/summary.json") == meta
