"""PPO on a train rank (slime.ray.train_actor.TrainActor, without Ray), fp32 on CPU, with --num-critic-only-steps 2.

    python tests/backends/megatron/ppo_actor.py MODEL_DIR WORK_DIR run      # rollouts 0-3, saved after rollout 1
    python tests/backends/megatron/ppo_actor.py MODEL_DIR WORK_DIR resume   # a fresh rank from that save: 2-3

Every rollout trains on the same fixed batch (WORK_DIR/rollout: 4 groups of 4, rewards 0/1), so the critic's
value loss should fall from rollout to rollout. One JSON row per rollout: its train metrics (perf/ left out),
the largest change of the actor's weights since the start and of the critic's since the rollout before, and the
critic's mean value of the batch. `resume` rows also carry the rollout id `init` returned.
"""

import json
import sys
from pathlib import Path

import torch
from train_actor_cycle import free_port, rollout

from slime.config import Config
from slime.ray.train_actor import TrainActor

CRITIC_ONLY = 2


def _actor(model_dir: str, work: Path) -> TrainActor:
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "ppo"},
        "checkpoint": {"hf_checkpoint": model_dir, "save": str(work / "ckpt")},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 4},
        "algorithm": {"advantage_estimator": "ppo", "num_critic_only_steps": CRITIC_ONLY, "gamma": 1.0,
                      "lambd": 0.95, "kl_coef": 0.01},
        # two optimizer steps per rollout: the actor's ratio and the critic's value clipping both move
        "train": {"global_batch_size": 8, "micro_batch_size": 4, "lr": 3e-4}})
    return TrainActor(config.model_dump(mode="json"), 0, 1)


def _params(models: list) -> list[torch.Tensor]:
    return [p.detach().float().clone() for m in models for p in m.parameters()]


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _train(actor: TrainActor, uri: str, rollout_ids: range, **extra) -> None:
    from slime.backends.megatron.critic import compute_values
    from slime.storage import read_samples

    start = _params(actor.models)
    for rollout_id in rollout_ids:
        before = _params(actor.critic_models)
        metrics = actor.train(rollout_id, uri)
        values = compute_values(actor.critic_models, read_samples(uri), micro_batch_size=8)
        row = {k: v for k, v in metrics.items() if not k.startswith("perf/")}
        print(json.dumps({"case": rollout_id, **extra, "metrics": row, "actor_change": _gap(_params(actor.models), start),
                          "critic_change": _gap(_params(actor.critic_models), before),
                          "value_mean": float(torch.cat(values).mean())}), flush=True)
        if rollout_id == CRITIC_ONLY - 1 and not extra:
            actor.save(rollout_id)


def run(model_dir: str, work: Path) -> None:
    actor = _actor(model_dir, work)
    assert actor.init(f"tcp://127.0.0.1:{free_port()}") == 0
    uri = str(work / "rollout")
    rollout(uri, 4, 4)
    _train(actor, uri, range(4))


def resume(model_dir: str, work: Path) -> None:
    actor = _actor(model_dir, work)
    start = actor.init(f"tcp://127.0.0.1:{free_port()}")
    _train(actor, str(work / "rollout"), range(start, 4), resumed_at=start)


if __name__ == "__main__":
    {"run": run, "resume": resume}[sys.argv[3]](sys.argv[1], Path(sys.argv[2]))
