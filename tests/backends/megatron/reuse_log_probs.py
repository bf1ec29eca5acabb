"""A train rank (slime.ray.train_actor.TrainActor, without Ray) with and without the old-log-prob pass, fp32 on CPU.

    python tests/backends/megatron/reuse_log_probs.py MODEL_DIR WORK_DIR reuse      # one step per rollout
    python tests/backends/megatron/reuse_log_probs.py MODEL_DIR WORK_DIR kl-coef    # kl_coef > 0 excludes it

`reuse`: GRPO with a KL loss (the reference pass stays), --use-rollout-entropy, global_batch_size 8. Rollout 0
(8 samples) trains the actor away from the reference; then rollout 1 (8 samples) is trained twice from the same
weights: with the pass forced (`can_reuse_log_probs` patched to False), then as the rank decides (it skips
the pass). One JSON row per run: the step's metrics and how many log-prob passes ran on the actor and on the
reference. Then a rollout of 16 samples (two optimizer steps) must run the pass again, and rollout 3, half of whose
samples lack rollout log-probs, is trained both ways. `kl-coef`: kl_coef 0.1 on
a rollout of one step: the pass runs.
"""

import json
import sys
from pathlib import Path

from train_actor_cycle import free_port, rollout

import slime.backends.megatron.logprobs as logprobs
import slime.ray.train_actor as train_actor
from slime.config import Config
from slime.ray.train_actor import TrainActor
from slime.ray.train_weights import copy_weights, snapshot
from slime.storage import read_samples, write_samples

KEYS = ("train/loss", "train/grad_norm", "train/pg_loss", "train/ppo_kl", "train/pg_clipfrac", "train/kl_loss",
        "train/train_rollout_logprob_abs_diff", "rollout/log_probs", "rollout/kl", "rollout/entropy",
        "rollout/advantages")


def counting(actor: TrainActor) -> dict[str, int]:
    """Count compute_log_probs calls on the actor's and the reference's models."""
    calls = {"actor": 0, "ref": 0}
    original = logprobs.compute_log_probs

    def spy(models, *args, **kwargs):
        calls["actor" if models is actor.models else "ref"] += 1
        return original(models, *args, **kwargs)

    logprobs.compute_log_probs = spy
    return calls


def train(actor: TrainActor, rollout_id: int, uri: str, case: str) -> None:
    calls = counting(actor)
    m = actor.train(rollout_id, uri)
    print(json.dumps({"case": case, "calls": calls, **{k: m.get(k) for k in KEYS},
                      "leaked": [k for k in m if "reused_log_probs" in k]}), flush=True)


def reuse(model_dir: str, work: Path) -> None:
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "reuse"},
        "checkpoint": {"hf_checkpoint": model_dir},
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 4, "num_rollout": 3},
        "algorithm": {"use_kl_loss": True, "kl_loss_coef": 0.1, "use_rollout_entropy": True},
        "train": {"global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-3}})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    actor.init(f"tcp://127.0.0.1:{free_port()}")
    rollout(str(work / "r8"), 2, 4)
    rollout(str(work / "r16"), 4, 4)
    train(actor, 0, str(work / "r8"), "first")
    before = snapshot(actor.models)
    decide = train_actor.can_reuse_log_probs
    train_actor.can_reuse_log_probs = lambda *args: False
    train(actor, 1, str(work / "r8"), "recompute")
    train_actor.can_reuse_log_probs = decide
    copy_weights(before, actor.models)
    train(actor, 1, str(work / "r8"), "reuse")
    train(actor, 2, str(work / "r16"), "two steps")
    # half the samples without rollout log-probs: the gap is over the other half's tokens on both paths
    mixed = read_samples(str(work / "r8"))
    for sample in mixed[1::2]:
        sample.rollout_log_probs = None
    write_samples(str(work / "mixed"), mixed)
    before = snapshot(actor.models)
    train_actor.can_reuse_log_probs = lambda *args: False
    train(actor, 3, str(work / "mixed"), "mixed recompute")
    train_actor.can_reuse_log_probs = decide
    copy_weights(before, actor.models)
    train(actor, 3, str(work / "mixed"), "mixed reuse")
    actor.close()


def kl_coef(model_dir: str, work: Path) -> None:
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "klcoef"},
        "checkpoint": {"hf_checkpoint": model_dir},
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 4, "num_rollout": 1},
        "algorithm": {"kl_coef": 0.1, "advantage_estimator": "reinforce_plus_plus_baseline",
                      "normalize_advantages": True},
        "train": {"global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-3}})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    actor.init(f"tcp://127.0.0.1:{free_port()}")
    rollout(str(work / "r8"), 2, 4)
    train(actor, 0, str(work / "r8"), "kl_coef")
    actor.close()


if __name__ == "__main__":
    {"reuse": reuse, "kl-coef": kl_coef}[sys.argv[3]](sys.argv[1], Path(sys.argv[2]))
