"""slime's trainer flags on a real train rank (train_actor_flags.py, fp32 on CPU): the reference follows the
actor every --ref-update-interval rollouts, --use-stateless-adam starts Adam's moments afresh each step,
--data-pad-size-multiplier rounds micro-batch widths, --log-probs-chunk-size scores in chunks with the same
values, --recompute-loss-function scores again in the backward pass with the same step, --log-correct-samples reports the correct responses, the torch profiler writes traces, and
--disable-compute-advantages-and-returns trains on the advantages the samples carry, and --keep-old-actor
takes old log-probs under the weights last synced to the engines.

The four cases are independent processes, run two at a time by one module fixture (script_rows.run_scripts)."""

import pytest
from script_rows import rows_by_case, run_scripts

CASES = ("trainer", "no-advantages", "old-actor", "reward-post-process")


@pytest.fixture(scope="module")
def runs(tiny_kit, tmp_path_factory):
    """Each case's rows, as a Future (a failed script fails the test that reads it, not the others)."""
    return run_scripts({case: ("train_actor_flags.py", tiny_kit.model_dir, tmp_path_factory.mktemp(case), case)
                        for case in CASES}, timeout=600)


def test_trainer_flags_change_what_the_rank_does(runs):
    rows = rows_by_case(runs["trainer"].result())
    r0, r1, r2 = (rows[f"rollout {i}"] for i in range(3))
    # the reference starts as the actor (KL 0), drifts after one trained rollout, and is the actor again after
    # the update that follows rollout 1 ((1 + 1) % 2 == 0)
    assert r0["kl"] == 0.0 and r1["kl"] > 1e-4 and r2["kl"] == 0.0, rows
    assert [r["ref_updated"] for r in (r0, r1, r2)] == [0.0, 1.0, 0.0]
    assert [r["adam_steps"] for r in (r0, r1, r2)] == [1.0, 1.0, 1.0]  # plain Adam would count 1, 2, 3
    assert r0["max_microbatch_tokens"] == 8 * 16  # 8 rows of 7 tokens, padded to 16 (56 without)
    # rewards alternate 0/1: every correct response (length 4) is in the first quarter of 16 tokens
    assert abs(r0["correct_p25"] - 1.0) < 1e-6 and r0["correct_p100"] == 0.0 and r0["correct_entropy"] > 0
    chunked = rows["chunked"]
    assert chunked["chunk_widths"] == [2] and chunked["whole_widths"] == [4] and chunked["gap"] == 0.0
    plain, recomputed = rows["recompute"]["plain"], rows["recompute"]["recomputed"]
    assert recomputed["loss"] == plain["loss"] and recomputed["grad_norm"] == plain["grad_norm"], rows["recompute"]
    # chunk 2 over 4 response positions: 2 normalisers (logsumexp) per micro-batch's scoring, each giving the
    # log-probs and the entropies of its chunk; recomputed: each scoring runs again in the backward pass
    assert plain["scorings"] == 2 * plain["microbatches"] and recomputed["scorings"] == 2 * plain["scorings"]
    files = rows["traces"]["files"]
    assert any(f.startswith("train_actor_rank_0.") and f.endswith(".pt.trace.json.gz") for f in files), files
    assert any(f.startswith("train_log_probs_rank_0.") for f in files), files


def test_no_advantage_computation_trains_on_the_samples_advantages_with_a_padded_vocabulary(runs):
    row = runs["no-advantages"].result()[0]
    # ratio 1 on the first step: pg_loss = -mean(advantage) = -0.5 (GRPO on these rewards would give ~0)
    assert row["pg_loss"] == -0.5 and row["has_log_probs"] is False and row["grad_norm"] > 0, row
    assert row["embedding_rows"] == [512]  # --padded-vocab-size (the kit's vocabulary: 384, padded to 384)


def test_keep_old_actor_scores_with_the_synced_weights(runs):
    rows = rows_by_case(runs["old-actor"].result())
    r0, r1, r2 = (rows[f"rollout {i}"]["log_probs"] for i in range(3))
    # rollouts 0 and 1: no sync yet, the old actor is the loaded policy although rollout 0 trained the actor;
    # after the sync that follows rollout 1 it is the trained actor
    assert r0 == r1 and r2 != r0, rows


def test_a_reward_post_process_plugin_replaces_the_group_normalisation(runs):
    row = runs["reward-post-process"].result()[0]
    # GRPO's advantage is the normalised reward on every token: the plugin's 1.0 (its own centring would give 0)
    assert row["advantages"] == 1.0, row
