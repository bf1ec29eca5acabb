"""One rank of the pipeline-parallel tests (test_train_pp.py starts it through multirank.run_ranks).

    python pp_parity.py parity HF_DIR OUT_DIR TP PP   (RANK, WORLD_SIZE, INIT_METHOD in the environment)
    python pp_parity.py resume HF_DIR OUT_DIR TP PP
    python pp_parity.py load   HF_DIR OUT_DIR TP PP   (after `resume` with TP 1 PP 2)

World size = TP x PP x DP; each data-parallel rank trains on every DP-th sample. `parity`: one SGD SFT step, then GRPO: old log-probs recomputed by
`compute_log_probs` (forward-only through the pipeline; the KL reference's from a bare model loaded from
HF_DIR), two policy steps on them (entropy and KL terms, gradient clipping); prints the log-probs, entropies
and each step's metrics; then a PPO critic (value head from a fixed seed): values, two SGD value-loss steps
on jittered returns, values after; and rank 0 writes the exported HF weights
to OUT_DIR/tp<TP>pp<PP>dp<DP>.safetensors. `resume`: Adam steps 1..4 saving at 2, then a fresh model and
optimizer load that checkpoint and take steps 3..4 again; prints each rank's weight and optimizer digests
and the log-probs at the save. `load`: that PP 2 checkpoint's weights into this layout; prints its log-probs.
"""

import hashlib
import json
import sys
from pathlib import Path

from dp_parity import jitter
from multirank import rank_env
from parity_samples import make_samples
from safetensors.torch import save_file

from slime.backends.megatron.bridge import (
    build_model,
    close_megatron,
    export_hf_weights,
    init_megatron,
    make_bridge,
)
from slime.backends.megatron.checkpoint import load_checkpoint, load_model_checkpoint, save_checkpoint
from slime.backends.megatron.critic import build_critic, compute_values
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.optimizer import build_optimizer, build_optimizer_and_scheduler
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.config import load_config

SFT = StepSettings(loss_type="sft_loss", micro_batch_size=1)
VALUE = StepSettings(loss_type="value_loss", micro_batch_size=2, value_clip=0.2)
GRPO = StepSettings(loss_type="policy_loss", micro_batch_size=2, temperature=0.8, entropy_coef=0.1, use_kl_loss=True,
                    kl_loss_coef=0.2, kl_loss_type="k3")


def parity(hf_dir: str, out_dir: Path, tp: int, pp: int, rank: int) -> None:
    from megatron.core import parallel_state

    bridge = make_bridge(hf_dir)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    vocab = bridge.hf_config.vocab_size
    dp = parallel_state.get_data_parallel_world_size()
    samples = make_samples(vocab)[parallel_state.get_data_parallel_rank()::dp]  # this data-parallel rank's share
    optimizer = build_optimizer(models, lr=0.5, clip_grad=1.0, optimizer="sgd")
    steps = [train_step(models, optimizer, samples, SFT, vocab_size=vocab)]
    old = compute_log_probs(models, samples, vocab_size=vocab, temperature=0.8, micro_batch_size=4,
                            with_entropy=True)
    ref = compute_log_probs(build_model(bridge, hf_dir), samples, vocab_size=vocab, temperature=0.8,
                            use_dynamic_batch_size=True, max_tokens_per_gpu=20)  # a bare (no DDP) model
    arrays = TrainArrays(old_log_probs=old.log_probs, ref_log_probs=ref.log_probs)
    for _ in range(2):
        steps.append(train_step(models, optimizer, samples, GRPO, vocab_size=vocab, arrays=arrays))
    critic = build_critic(bridge, hf_dir)
    values = compute_values(critic, samples, micro_batch_size=2)
    critic_arrays = TrainArrays(old_values=values, returns=[jitter(v, 0.5, seed=300 + x.index) for v, x in
                                                            zip(values, samples, strict=True)])
    critic_optimizer = build_optimizer(critic, lr=0.5, clip_grad=1.0, optimizer="sgd")
    value_steps = [train_step(critic, critic_optimizer, samples, VALUE, vocab_size=vocab, arrays=critic_arrays)
                   for _ in range(2)]
    after = compute_values(critic, samples, use_dynamic_batch_size=True, max_tokens_per_gpu=20)
    exported = [(name, t.detach().cpu().contiguous()) for name, t in export_hf_weights(bridge, models)]
    if rank == 0:
        save_file(dict(exported), str(out_dir / f"tp{tp}pp{pp}dp{dp}.safetensors"))
    print(json.dumps({"rank": rank, "indices": [x.index for x in samples], "log_probs": [v.tolist() for v in old.log_probs],
                      "entropies": [v.tolist() for v in old.entropies],
                      "ref_log_probs": [v.tolist() for v in ref.log_probs], "steps": steps,
                      "values": [v.tolist() for v in values], "values_after": [v.tolist() for v in after],
                      "value_steps": value_steps,
                      "exported": [name for name, _ in exported]}), flush=True)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def resume(hf_dir: str, save: str, rank: int) -> None:
    config = load_config(None, ["--lr", "1e-2", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
                                "--min-lr", "1e-4", "--weight-decay", "0.01"])
    bridge = make_bridge(hf_dir)
    vocab = bridge.hf_config.vocab_size
    samples = make_samples(vocab)

    def build():
        models = build_model(bridge, hf_dir, wrap_with_ddp=True)
        return (models, *build_optimizer_and_scheduler(models, config, total_steps=6))

    def step(models, optimizer, scheduler, k: int) -> dict:
        batch = samples[k % 2::2]  # a different half each step
        loss = train_step(models, optimizer, batch, SFT, vocab_size=vocab)["loss"]
        scheduler.step(1)
        inner = optimizer.optimizer
        state = digest(inner.state[p][key].reshape(-1) for g in inner.param_groups for p in g["params"]
                       for key in sorted(inner.state[p]))
        return {"step": k, "loss": loss, "weights": digest(models[0].parameters()), "optimizer": state}

    models, optimizer, scheduler = build()
    run = []
    for k in range(1, 5):
        run.append(step(models, optimizer, scheduler, k))
        if k == 2:
            save_checkpoint(models, save, k, optimizer=optimizer, scheduler=scheduler)
            saved = compute_log_probs(models, samples, vocab_size=vocab, micro_batch_size=3).log_probs
    models, optimizer, scheduler = build()
    state = load_checkpoint(models, f"{save}/iter_0000002", optimizer, scheduler)
    resumed = [step(models, optimizer, scheduler, k) for k in range(state.iteration + 1, 5)]
    print(json.dumps({"rank": rank, "run": run, "resumed": resumed, "saved_log_probs": [v.tolist() for v in saved]}),
          flush=True)


def load(hf_dir: str, path: str, rank: int) -> None:
    """The weights of a checkpoint saved under another layout (weights only, as export and --ref-load read
    them): the log-probs of the loaded model."""
    bridge = make_bridge(hf_dir)
    models = build_model(bridge)
    load_model_checkpoint(models, path)
    logp = compute_log_probs(models, make_samples(bridge.hf_config.vocab_size),
                             vocab_size=bridge.hf_config.vocab_size, micro_batch_size=3).log_probs
    print(json.dumps({"rank": rank, "log_probs": [v.tolist() for v in logp]}), flush=True)


def main() -> None:
    mode, hf_dir, out_dir, tp, pp = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    rank, world_size, init_method = rank_env()
    init_megatron(seed=0, tensor_parallel=tp, pipeline_parallel=pp, rank=rank, world_size=world_size,
                  init_method=init_method)
    if mode == "parity":
        parity(hf_dir, out_dir, tp, pp, rank)
    elif mode == "load":
        load(hf_dir, str(out_dir / "ckpt-tp1pp2" / "iter_0000002"), rank)
    else:
        resume(hf_dir, str(out_dir / f"ckpt-tp{tp}pp{pp}"), rank)


if __name__ == "__main__":
    main()
    close_megatron()
