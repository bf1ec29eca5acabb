"""On-policy distillation on a train rank (slime.ray.train_actor.TrainActor, without Ray), fp32 on CPU.

    python tests/backends/megatron/opd_actor.py MODEL_DIR WORK_DIR teacher   # WORK_DIR/teacher: iter 0 and 1
    python tests/backends/megatron/opd_actor.py MODEL_DIR WORK_DIR opd

`teacher`: a rank saves the HF weights as iteration 0 of WORK_DIR/teacher, trains one rollout at a large
learning rate and saves iteration 1 (a teacher that differs from the student). `opd`: a rank with --use-opd
--opd-type megatron: with --opd-teacher-ckpt-step 0 (the teacher is the student's starting weights) the
advantages are those without OPD; with step 1 they are the estimator's minus opd_kl_coef * (old - teacher
log-prob), the teacher's log-probs taken by a separate forward of that checkpoint; then a full `train`, the
offload slots, and the refusal of a teacher of another vocabulary or architecture. One JSON row per case.
"""

import json
import sys
from pathlib import Path

import torch
from train_actor_cycle import free_port, rollout

from slime.backends.megatron.bridge import build_model
from slime.backends.megatron.checkpoint import iteration_dir, load_model_checkpoint, read_checkpoint_manifest
from slime.backends.megatron.logprobs import compute_log_probs
from slime.config import Config
from slime.errors import ConfigError
from slime.ray.train_actor import TrainActor
from slime.storage import commit_directory, read_samples

COEF = 0.5


def teacher(model_dir: str, work: Path) -> None:
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "teacher"},
        "checkpoint": {"hf_checkpoint": model_dir, "save": str(work / "teacher"), "no_save_optim": True},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 1},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 3e-2}})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    actor.init(f"tcp://127.0.0.1:{free_port()}")
    actor.save(0)
    uri = str(work / "rollout-teacher")
    rollout(uri, 4, 4)
    m = actor.train(0, uri)
    actor.save(1)
    print(json.dumps({"case": "teacher", "grad_norm": m["train/grad_norm"]}), flush=True)


def _prepared(actor: TrainActor, uri: str) -> list:
    """The rollout's samples with their group-normalised rewards, as `train` prepares them."""
    samples = read_samples(uri)
    _, rewards = actor._rewards(samples, uri)
    for sample, reward in zip(samples, rewards, strict=True):
        sample.metadata["normalized_reward"] = reward
    return samples


def _advantages(actor: TrainActor, samples: list, with_teacher: bool) -> tuple[list, dict]:
    """`_arrays`' advantages and metrics, with the rank's teacher or (`with_teacher` False) without it."""
    kept = actor.teacher_models
    actor.teacher_models = kept if with_teacher else None
    try:
        arrays, stats = actor._arrays(0, samples)
    finally:
        actor.teacher_models = kept
    return arrays.advantages, stats


def _max_gap(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def opd(model_dir: str, work: Path) -> None:
    root = str(work / "teacher")
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "opd"},
        "checkpoint": {"hf_checkpoint": model_dir, "opd_teacher_load": root, "opd_teacher_ckpt_step": 0},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 1},
        "algorithm": {"use_opd": True, "opd_type": "megatron", "opd_kl_coef": COEF},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-3}})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    actor.init(f"tcp://127.0.0.1:{free_port()}")
    uri = str(work / "rollout-opd")
    rollout(uri, 4, 4)
    samples = _prepared(actor, uri)
    mask = [torch.tensor(s.loss_mask, dtype=torch.bool) for s in samples]

    # teacher = the student's starting weights (iteration 0): no OPD term
    base, _ = _advantages(actor, samples, with_teacher=False)
    same, stats = _advantages(actor, samples, with_teacher=True)
    print(json.dumps({"case": "teacher is student", "gap": _max_gap(same, base),
                      "reverse_kl": stats["rollout/opd_reverse_kl"],
                      "base_nonzero": max(float(a.abs().max()) for a in base)}), flush=True)

    # teacher = iteration 1 (trained): A - coef * (old - teacher), the teacher scored by a separate forward
    actor.config.checkpoint.opd_teacher_ckpt_step = 1
    actor._load_teacher()
    opd_adv, stats = _advantages(actor, samples, with_teacher=True)
    kwargs = dict(vocab_size=actor.bridge.hf_config.vocab_size, micro_batch_size=8)
    separate = build_model(actor.bridge)
    load_model_checkpoint(separate, iteration_dir(root, 1))
    teacher_lp = compute_log_probs(separate, samples, **kwargs).log_probs
    old = compute_log_probs(actor.models, samples, **kwargs).log_probs
    expected = [a - COEF * (o - t) for a, o, t in zip(base, old, teacher_lp, strict=True)]
    tokens = sum(int(m.sum()) for m in mask)
    teacher_mean = sum(float(t[m].sum()) for t, m in zip(teacher_lp, mask, strict=True)) / tokens
    kl_mean = sum(float((o - t)[m].sum()) for o, t, m in zip(old, teacher_lp, mask, strict=True)) / tokens
    print(json.dumps({"case": "trained teacher", "gap": _max_gap(opd_adv, expected),
                      "shift": _max_gap(opd_adv, base),
                      "teacher_log_probs": stats["rollout/teacher_log_probs"], "teacher_mean": teacher_mean,
                      "reverse_kl": stats["rollout/opd_reverse_kl"], "kl_mean": kl_mean}), flush=True)

    # a full train call, and what colocated offload parks
    m = actor.train(0, uri)
    keys = [key for key, _, _ in actor.frozen_slots()]
    tensors = sum(len({id(t) for t in [*mod.parameters(), *mod.buffers()]}) for mod in actor.teacher_models)
    trainable = sum(p.requires_grad for mod in actor.teacher_models for p in mod.parameters())
    print(json.dumps({"case": "train", "loss": m["train/loss"], "grad_norm": m["train/grad_norm"],
                      "train_reverse_kl": m["train/opd_reverse_kl"], "rollout_reverse_kl": m["rollout/opd_reverse_kl"],
                      "teacher_slots": sum(k.startswith("teacher") for k in keys), "teacher_tensors": tensors,
                      "teacher_trainable": trainable}), flush=True)

    # a teacher of another vocabulary, then of another architecture (its manifest records them)
    refusals = {}
    meta = read_checkpoint_manifest(iteration_dir(root, 1)).metadata
    for name, change in (("vocab", {"hf_config": {**meta["hf_config"], "vocab_size": 999}}),
                         ("layers", {"model_signature": {**meta["model_signature"], "num_layers": 7}})):
        other = work / f"other-{name}"
        other.mkdir()
        (other / "weights").write_text("-")
        commit_directory(str(other), "checkpoint", metadata={**meta, **change})
        actor.config.checkpoint.opd_teacher_load, actor.config.checkpoint.opd_teacher_ckpt_step = str(other), None
        try:
            actor._load_teacher()
            refusals[name] = "loaded"
        except ConfigError as exc:
            refusals[name] = str(exc)
    print(json.dumps({"case": "refusals", **refusals}), flush=True)


if __name__ == "__main__":
    {"teacher": teacher, "opd": opd}[sys.argv[3]](sys.argv[1], Path(sys.argv[2]))
