"""Eval rollout over several named datasets through the router: per-dataset overrides, pass@k, report
and store outputs; eval config errors name the file and the dataset."""

from __future__ import annotations

import json

import pytest
import yaml

from slime.errors import ConfigError
from slime.rollout import generate_rollout
from slime.rollout.eval import eval_datasets, pass_at_k
from slime.storage import read_samples
from slime.storage.fs import open_fs


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)


def test_eval_datasets_with_overrides_report_and_store(make_args, tiny_kit, tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"eval": {
        "defaults": {"n_samples_per_eval_prompt": 4, "custom_rm_path": "rollout_plugins.rm_first_of_four"},
        "datasets": [
            {"name": "arith", "path": f"{tiny_kit.eval}@[0:3]"},
            {"name": "short", "path": f"{tiny_kit.eval}@[3:5]", "n_samples_per_eval_prompt": 2,
             "max_response_len": 3, "temperature": 0.0, "custom_rm_path": "rollout_plugins.rm_one",
             "metadata_overrides": {"source": "short"}},
        ]}}))
    args = make_args(eval_config=str(config), eval_prompt_data={"train": f"{tiny_kit.train}@[0:2]"},
                     eval_max_response_len=5, custom_rm_path="rollout_plugins.rm_one",
                     run_id="evalrun", store=str(tmp_path / "store"))
    out = generate_rollout(args, 7, None, evaluation=True)
    m = out.metrics
    assert set(out.data) == {"arith", "short", "train"}
    arith = out.data["arith"]["samples"]
    assert len(arith) == 12 and [s.index for s in arith] == list(range(12))
    assert [s.group_index for s in arith] == [0] * 4 + [1] * 4 + [2] * 4
    assert m["eval/arith/mean_reward"] == 0.25
    assert m["eval/arith/pass@1"] == 0.25 and m["eval/arith/pass@2"] == pytest.approx(0.5)
    assert m["eval/arith/pass@4"] == 1.0 and "eval/arith/pass@8" not in m
    assert m["eval/arith/response_len/max"] <= 5  # eval_max_response_len
    short = out.data["short"]["samples"]
    assert len(short) == 4 and m["eval/short/mean_reward"] == 1.0 and m["eval/short/pass@2"] == 1.0
    assert all(s.response_length <= 3 and s.metadata["source"] == "short" for s in short)
    # temperature 0 overrides: both samples of a prompt are the same greedy response
    assert short[0].tokens == short[1].tokens and short[2].tokens == short[3].tokens
    truncated = sum(s.status.value == "truncated" for s in short) / 4
    assert m["eval/short/truncated_ratio"] == truncated == sum(out.data["short"]["truncated"]) / 4
    assert m["eval/train/samples"] == 2 and m["eval/train/mean_reward"] == 1.0  # n=1 default
    assert all(m[f"eval/{n}/failed"] == 0 for n in out.data)
    # store: one shard set per dataset and a committed summary equal to the metrics
    fs, path = open_fs(m["eval/summary_uri"])
    summary = json.loads(fs.cat_file(path))
    assert summary["arith"]["pass@2"] == m["eval/arith/pass@2"] and summary["short"]["prompts"] == 2
    stored = read_samples(m["eval/summary_uri"].rsplit("/", 2)[0] + "/000007-arith")
    assert [s.tokens for s in stored] == [s.tokens for s in arith]


@pytest.mark.parametrize(("content", "message"), [
    ({"eval": {"datasets": [{"name": "a", "path": "x.jsonl", "temprature": 1.0}]}},
     r"eval.datasets\[0\]: temprature: Extra inputs"),
    ({"eval": {"datasets": [{"name": "a/b", "path": "x.jsonl"}]}}, r"eval.datasets\[0\]: name"),
    ({"eval": {"defaults": {"n_samples": 2}, "datasets": []}}, r"unknown field\(s\) \['n_samples'\]"),
    ({"eval": {"datasets": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}}, "more than once"),
])
def test_eval_config_errors_name_the_file_and_dataset(tmp_path, content, message):
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump(content))

    class Args:
        eval_config = str(config)
        eval_prompt_data = None

    with pytest.raises(ConfigError, match=message) as info:
        eval_datasets(Args())
    assert str(config) in str(info.value) or "more than once" in message


def test_eval_max_prompt_len_and_tool_key_apply_to_eval_prompts(tiny_kit, tmp_path):
    from slime.config import load_config
    from slime.rollout.eval import EvalDatasetConfig, load_dataset

    data = tmp_path / "eval.jsonl"
    rows = [{"prompt": "1+1=", "label": "2", "my_tools": [{"name": "calc"}]},
            {"prompt": "12345+67890+13579+24680=", "label": "x", "my_tools": []}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = EvalDatasetConfig(name="t", path=str(data))
    base = ["--hf-checkpoint", str(tiny_kit.model_dir), "--eval-tool-key", "my_tools"]
    everything = load_dataset(load_config(None, base).as_namespace(), ds)
    assert len(everything) == 2 and everything[0].metadata["tools"] == [{"name": "calc"}]  # eval_tool_key's
    short = load_dataset(load_config(None, [*base, "--eval-max-prompt-len", "8"]).as_namespace(), ds)
    assert [s.prompt for s in short] == ["1+1="]


def test_eval_config_paths_are_relative_to_that_file(tmp_path):
    config = tmp_path / "configs" / "eval.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({"eval": {"datasets": [{"name": "rel", "path": "../data/e.jsonl"},
                                                            {"name": "abs", "path": "/srv/e.jsonl"},
                                                            {"name": "url", "path": "s3://b/e.jsonl@[0:4]"}]}}))

    class Args:
        eval_config = str(config)
        eval_prompt_data = None

    paths = {d.name: d.path for d in eval_datasets(Args)}
    assert paths == {"rel": str(tmp_path / "data" / "e.jsonl"), "abs": "/srv/e.jsonl", "url": "s3://b/e.jsonl@[0:4]"}
