"""Tasks rejection_sampling and evaluate through `task.fn` (real built-in engine behind the router, no
Prefect API), and the pure parts of the rl task and flow: metric table rows and the reward curve PNG."""

import json
import struct
import zlib

import pytest

from flows._plot import line_chart
from flows.evaluate import eval_inputs
from flows.rl import reward_curve
from slime.stages.evaluate import plan_evaluate
from slime.storage import is_committed, manifest_hash, read_samples
from tasks._stage import with_fields
from tasks.evaluate import evaluate
from tasks.rejection_sampling import rejection_sampling
from tasks.rl import SUMMARY_BLOCK, TABLE_WINDOW, table_row, table_view


@pytest.fixture(scope="module")
def small(kit_config, tiny_kit, tmp_path_factory):
    """Few prompts, short answers, the store in a temporary directory."""
    return with_fields(kit_config, run__store=str(tmp_path_factory.mktemp("store")), run__run_id="r",
                       rollout__rollout_max_response_len=4, rollout__n_samples_per_prompt=2,
                       eval__eval_prompt_data={"arithmetic": f"{tiny_kit.eval}@[0:6]"})


def test_rejection_sampling_commits_accepted_and_every_candidate(small, tiny_kit):
    output = f"{small.run.store}/r/rejection_sampling"
    inputs = {"load": str(tiny_kit.model_dir), "prompt_data": f"{tiny_kit.train}@[0:5]"}
    result = rejection_sampling.fn(with_fields(small, rejection_sampling__rs_reward_threshold=None), "r", inputs,
                                   output)
    assert json.loads(json.dumps(result)) == result
    accepted, candidates = result["artifacts"]["accepted"], result["artifacts"]["candidates"]
    assert accepted["uri"] == f"{output}/accepted" and candidates["uri"] == f"{output}/accepted-candidates"
    for artifact in (accepted, candidates):
        assert is_committed(artifact["uri"]) and artifact["manifest_hash"] == manifest_hash(artifact["uri"])
    m = result["metrics"]
    assert m["prompts"] == 5 and m["samples"] == 10 == len(read_samples(candidates["uri"]))
    assert m["accepted"] == len(read_samples(accepted["uri"])) and m["reused"] is False
    assert result["seconds"]["sample and score"] > 0


def test_evaluate_writes_where_the_plan_says_and_refuses_another_output(small, tiny_kit, tmp_path):
    model = str(tiny_kit.model_dir)
    planned = plan_evaluate(with_fields(small, checkpoint__load=model)).uri
    inputs = eval_inputs(small, model)
    assert set(inputs) == {"load", "eval_data_arithmetic"}
    with pytest.raises(RuntimeError, match="planned"):
        evaluate.fn(small, "r", inputs, str(tmp_path / "elsewhere"))
    outcome = evaluate.fn(small, "r", inputs, planned)
    # the refused call had evaluated (and committed) already: its result is reused, shown as Prefect's cache hits
    assert outcome.name == "Cached" and outcome.is_completed() and "reused" in outcome.message
    result = outcome.data
    (name, artifact), = result["artifacts"].items()
    assert name == "eval_result" and artifact["uri"] == planned and is_committed(planned)
    figures = result["metrics"]["datasets"]["arithmetic"]
    assert 0.0 <= figures["mean_reward"] <= 1.0 and result["metrics"]["checkpoint"] == model


def test_metric_rows_take_the_headline_numbers_and_eval_rewards():
    record = {"rollout_id": 3, "weight_version": 4, "rl/reward_mean": 0.25, "rl/grad_norm": 1.5,
              "eval/arithmetic/mean_reward": 0.5, "eval/arithmetic/pass@1": 0.5}
    row = table_row(record, prefect_s=0.1234)
    assert row["iteration"] == 3 and row["reward_mean"] == 0.25 and row["grad_norm"] == 1.5
    assert row["ppo_kl"] is None and row["eval_mean_reward"] == "arithmetic 0.5000" and row["prefect_s"] == 0.123
    assert row["staleness"] is None and row["stale_dropped"] is None


def test_metric_rows_key_an_eval_by_weight_version_and_checkpoint():
    record = {"rollout_id": 3, "eval/rollout_id": 3, "eval/weight_version": 4, "eval/checkpoint": "c/iter_0000003",
              "eval/arithmetic/mean_reward": 0.5}
    row = table_row(record)
    assert (row["eval_weight_version"], row["eval_checkpoint"], row["eval_mean_reward"]) == \
        (4, "c/iter_0000003", "arithmetic 0.5000")
    assert table_row({"rollout_id": 2})["eval_weight_version"] is None


def test_metric_rows_show_fully_async_staleness_and_idle_time():
    record = {"rollout_id": 5, "async/staleness/lag_0": 12, "async/staleness/lag_1": 4, "async/staleness/lag_10": 1,
              "async/staleness/max": 10, "async/groups/stale_dropped": 2, "async/groups/stale_regenerated": 0,
              "perf/trainer_idle_s": 0.25, "perf/engine_idle_s": 1.5}
    row = table_row(record)
    assert row["staleness"] == "0:12 1:4 10:1"  # versions behind: samples, in order
    assert (row["stale_dropped"], row["stale_regenerated"], row["trainer_idle_s"], row["engine_idle_s"]) == \
        (2, 0, 0.25, 1.5)


def png_size(png: bytes) -> tuple[int, int, bytes]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    start = png.index(b"IDAT")
    (length,) = struct.unpack(">I", png[start - 4:start])
    return width, height, zlib.decompress(png[start + 4:start + 4 + length])


def test_reward_curve_is_a_png_with_a_caption_naming_its_series():
    records = {0: {"rl/reward_mean": 0.1}, 1: {"rl/reward_mean": 0.3, "eval/arithmetic/mean_reward": 0.2}}
    png, caption = reward_curve(records)
    width, height, raw = png_size(png)
    assert len(raw) == height * (1 + 3 * width)
    assert "rollout reward mean" in caption and "eval arithmetic mean reward" in caption and "0.1000" in caption
    assert raw != png_size(line_chart([]))[2]  # the curve is drawn, not an empty frame


def test_a_fresh_rl_start_moves_the_earlier_attempts_step_outputs_aside(kit_config, tmp_path):
    from tasks.rl import set_aside_step_outputs

    config = with_fields(kit_config, run__store=str(tmp_path))
    for name in ("rollout/000000/part-0.arrow", "eval/000000-summary/summary.json", "rl/metrics.jsonl"):
        (tmp_path / "r" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "r" / name).write_text("x")
    moved = set_aside_step_outputs(config, "r")
    assert len(moved) == 3 and all(".replaced-" in m for m in moved)
    assert not (tmp_path / "r" / "rollout").exists() and not (tmp_path / "r" / "eval").exists()
    assert not (tmp_path / "r" / "rl" / "metrics.jsonl").exists() and (tmp_path / "r" / "rl").is_dir()
    assert set_aside_step_outputs(config, "r") == []  # nothing left: nothing moved


def test_the_metrics_table_stays_bounded_however_long_the_run():
    rows = [{"iteration": i, "weight_version": i + 1, "reward_mean": i % 2, "ppo_kl": None, "staleness": None}
            for i in range(3000)]
    view = table_view(rows)
    assert len(view) == (3000 - TABLE_WINDOW) // SUMMARY_BLOCK + (3000 - TABLE_WINDOW) % SUMMARY_BLOCK + TABLE_WINDOW
    assert len(view) < 150 and view[-TABLE_WINDOW:] == rows[-TABLE_WINDOW:]  # the recent ones row by row
    assert view[0] == {"iteration": "0-99", "weight_version": 50.5, "reward_mean": 0.5}  # averaged, Nones dropped
    # the iterations between the last full block and the window stay row by row: nothing is left out
    shown = [r["iteration"] for r in view if isinstance(r["iteration"], int)]
    assert shown == list(range(2900, 3000))
    assert table_view(rows[:10]) == rows[:10]
