"""A train rank (slime.ray.train_actor.TrainActor, without Ray) under slime's trainer flags, fp32 on CPU.

    python tests/backends/megatron/train_actor_flags.py MODEL_DIR WORK_DIR trainer      # flags of the train pass
    python tests/backends/megatron/train_actor_flags.py MODEL_DIR WORK_DIR no-advantages
    python tests/backends/megatron/train_actor_flags.py MODEL_DIR WORK_DIR old-actor
    python tests/backends/megatron/train_actor_flags.py MODEL_DIR WORK_DIR reward-post-process

`trainer`: --ref-update-interval 2 (with a KL reference), --use-stateless-adam, --log-correct-samples,
--data-pad-size-multiplier 16, --log-probs-chunk-size 2 and the torch profiler on train_actor and
train_log_probs, then --recompute-loss-function against a plain step at lr 0,
over three rollouts; one JSON row per rollout (KL to the reference, Adam's largest step count, ...), one
for the chunked log-prob pass, one listing the trace files. `no-advantages`: one rollout with
--disable-compute-advantages-and-returns, whose samples carry their advantages, and --padded-vocab-size 512. `old-actor`:
--keep-old-actor with update_weights_interval 2 over three rollouts of the same samples, the weights synced
(as far as the rank knows: `keep_old_weights_after_sync`) after the second. `reward-post-process`:
--custom-reward-post-process-path (`ones` below) in place of GRPO's group normalisation.
"""

import json
import sys
from pathlib import Path

import torch
from train_actor_cycle import free_port, rollout

from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.config import Config
from slime.ray.train_actor import TrainActor
from slime.storage import read_samples


def adam_steps(actor: TrainActor) -> float:
    """The largest `step` count over Adam's per-parameter state."""
    steps = [float(state["step"]) for inner in actor.optimizer.chained_optimizers
             for state in inner.optimizer.state.values() if "step" in state]
    return max(steps)


def trainer(model_dir: str, work: Path) -> None:
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "flags", "log_correct_samples": True,
                "profile_target": ["train_actor", "train_log_probs"],
                "tensorboard_dir": str(work / "traces")},
        "checkpoint": {"hf_checkpoint": model_dir, "no_save_optim": True},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 3,
                    "rollout_max_response_len": 16},
        "algorithm": {"use_kl_loss": True, "kl_loss_coef": 0.0, "ref_update_interval": 2},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-3, "use_stateless_adam": True,
                  "data_pad_size_multiplier": 16, "log_probs_chunk_size": 2},
        "megatron": {"use_pytorch_profiler": True, "profile_step_start": 0, "profile_step_end": 1}})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    start = actor.init(f"tcp://127.0.0.1:{free_port()}")
    for rollout_id in range(start, 3):
        uri = str(work / f"rollout{rollout_id}")
        rollout(uri, 4, 4)
        m = actor.train(rollout_id, uri)
        print(json.dumps({"case": f"rollout {rollout_id}", "kl": m["rollout/kl"], "adam_steps": adam_steps(actor),
                          "ref_updated": m.get("train/ref_updated", 0.0),
                          "max_microbatch_tokens": m["train/max_microbatch_tokens"],
                          "correct_p25": m["rollout/correct_length/p25"],
                          "correct_p100": m["rollout/correct_length/p100"],
                          "correct_entropy": m["rollout/correct_entropy"]}), flush=True)
    # the chunked pass scores 2 response positions per normaliser (logsumexp over the vocabulary) and gives the
    # unchunked values
    samples = read_samples(str(work / "rollout0"))
    widths: list[int] = []
    logsumexp = torch.logsumexp

    def spy(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        widths.append(x.shape[1])
        return logsumexp(x, *args, **kwargs)

    kwargs = dict(vocab_size=actor.bridge.hf_config.vocab_size, micro_batch_size=8)
    torch.logsumexp = spy
    chunked = compute_log_probs(actor.models, samples, chunk_size=2, **kwargs).log_probs
    chunked_widths, widths[:] = sorted(set(widths)), []
    whole = compute_log_probs(actor.models, samples, **kwargs).log_probs
    torch.logsumexp = logsumexp
    gap = max(float((a - b).abs().max()) for a, b in zip(chunked, whole, strict=True))
    print(json.dumps({"case": "chunked", "chunk_widths": chunked_widths, "whole_widths": sorted(set(widths)),
                      "gap": gap}), flush=True)
    # --recompute-loss-function: at lr 0, the same step metrics, with the scoring run again in the backward
    for group in actor.optimizer.param_groups:
        group["lr"] = 0.0
    steps = {}
    for recompute in (False, True):
        calls: list[int] = []
        torch.logsumexp = lambda x, *a, calls=calls, **k: calls.append(1) or logsumexp(x, *a, **k)
        settings = StepSettings.from_config(config)
        settings.recompute_loss_function, settings.use_kl_loss = recompute, False
        m = train_step(actor.models, actor.optimizer, samples, settings, vocab_size=kwargs["vocab_size"],
                       arrays=TrainArrays(advantages=[0.5] * len(samples)))
        torch.logsumexp = logsumexp
        steps[recompute] = {"loss": m["loss"], "grad_norm": m["grad_norm"], "scorings": len(calls),
                            "microbatches": m["num_microbatches"]}
    print(json.dumps({"case": "recompute", "plain": steps[False], "recomputed": steps[True]}), flush=True)
    actor.close()
    traces = sorted(p.name for p in (work / "traces").iterdir())
    print(json.dumps({"case": "traces", "files": traces}), flush=True)


def no_advantages(model_dir: str, work: Path) -> None:
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "noadv"},
        "checkpoint": {"hf_checkpoint": model_dir},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 1},
        "algorithm": {"disable_compute_advantages_and_returns": True},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-4},
        "megatron": {"padded_vocab_size": 512}})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    actor.init(f"tcp://127.0.0.1:{free_port()}")
    uri = str(work / "rollout-adv")
    rollout(uri, 4, 4, advantage=0.5)
    m = actor.train(0, uri)
    rows = [p.shape[0] for n, p in actor.models[0].named_parameters() if n.endswith("word_embeddings.weight")]
    print(json.dumps({"case": "no advantages", "pg_loss": m["train/pg_loss"], "embedding_rows": rows,
                      "has_log_probs": "rollout/log_probs" in m, "grad_norm": m["train/grad_norm"]}), flush=True)


def ones(args, samples):
    """--custom-reward-post-process-path (slime's signature): the raw rewards kept, every normalised reward 1."""
    return [s.reward for s in samples], [1.0] * len(samples)


def reward_post_process(model_dir: str, work: Path) -> None:
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "rpp"},
        "checkpoint": {"hf_checkpoint": model_dir},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 1},
        "reward": {"custom_reward_post_process_path": "train_actor_flags.ones"},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-4}})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    actor.init(f"tcp://127.0.0.1:{free_port()}")
    uri = str(work / "rollout-rpp")
    rollout(uri, 4, 4)  # rewards 0/1 inside each group: GRPO's own normalisation would centre them on 0
    m = actor.train(0, uri)
    print(json.dumps({"case": "reward post-process", "advantages": m["rollout/advantages"]}), flush=True)


def old_actor(model_dir: str, work: Path) -> None:
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "old"},
        "checkpoint": {"hf_checkpoint": model_dir},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 3},
        "algorithm": {"keep_old_actor": True},
        "sync": {"update_weights_interval": 2},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-3}})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    actor.init(f"tcp://127.0.0.1:{free_port()}")
    uri = str(work / "rollout-same")
    rollout(uri, 4, 4)
    for rollout_id in range(3):
        m = actor.train(rollout_id, uri)
        print(json.dumps({"case": f"rollout {rollout_id}", "log_probs": m["rollout/log_probs"]}), flush=True)
        if rollout_id == 1:
            actor.keep_old_weights_after_sync()


if __name__ == "__main__":
    {"trainer": trainer, "no-advantages": no_advantages, "old-actor": old_actor,
     "reward-post-process": reward_post_process}[sys.argv[3]](sys.argv[1], Path(sys.argv[2]))
