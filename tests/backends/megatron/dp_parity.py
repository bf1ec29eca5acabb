"""One rank of the data-parallel parity test (test_train_dp.py starts it through multirank.run_ranks).

    python dp_parity.py HF_DIR OUT_DIR   (RANK, WORLD_SIZE, INIT_METHOD in the environment)

Every rank builds the same model and takes `STEPS` train steps on its share of the same global batch:
with world size 2, rank 0 gets samples 0..3 and rank 1 samples 4..5 (unequal shares, so a per-rank
denominator would show). Rank 0 writes the exported weights to OUT_DIR/<world>-<case>.safetensors and
every rank prints one JSON line per case with the step metrics.
"""

import json
import sys
from pathlib import Path

import torch
from multirank import rank_env
from parity_samples import LENGTHS, make_samples
from safetensors.torch import save_file

from slime.backends.megatron.bridge import (
    build_model,
    close_megatron,
    export_hf_weights,
    init_megatron,
    make_bridge,
)
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.backends.megatron.whiten import whiten_over_dp

STEPS = 2
def jitter(values: torch.Tensor, amount: float, seed: int) -> torch.Tensor:
    """`values` plus uniform noise in [-amount, amount)."""
    generator = torch.Generator().manual_seed(seed)
    return values + amount * (2 * torch.rand(values.shape, generator=generator) - 1)


CASES = {
    # (settings, optimizer kwargs, use_distributed_optimizer)
    "policy kl entropy tis, per-sample, sgd": (
        StepSettings(loss_type="policy_loss", micro_batch_size=1, use_kl_loss=True, kl_loss_coef=0.2,
                     kl_loss_type="low_var_kl", entropy_coef=0.05, use_tis=True, tis_clip=1.2, tis_clip_low=0.8),
        dict(optimizer="sgd", lr=0.5), False),
    "sft per-token, dynamic batch, sgd": (
        StepSettings(loss_type="sft_loss", calculate_per_token_loss=True, use_dynamic_batch_size=True,
                     max_tokens_per_gpu=24),
        dict(optimizer="sgd", lr=0.5), False),
    "policy per-sample, adam, distributed optimizer": (
        StepSettings(loss_type="policy_loss", micro_batch_size=2, entropy_coef=0.05),
        dict(optimizer="adam", lr=1e-2, adam_eps=1e-3), True),
}


def main() -> None:
    hf_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world_size, init_method = rank_env()
    init_megatron(seed=0, rank=rank, world_size=world_size, init_method=init_method)
    shares = [[0, 1, 2, 3], [4, 5]] if world_size == 2 else [list(range(len(LENGTHS)))]
    mine = [make_samples(1000)[i] for i in shares[rank]]
    raw = [torch.linspace(-1.0, 2.0, x.response_length) * (x.index + 1) for x in mine]
    whitened = whiten_over_dp(mine, raw)
    print(json.dumps({"case": "whiten", "rank": rank, "indices": shares[rank],
                      "advantages": [w.tolist() for w in whitened]}), flush=True)
    for case, (settings, optim, distributed) in CASES.items():
        bridge = make_bridge(hf_dir)
        models = build_model(bridge, hf_dir, wrap_with_ddp=True, use_distributed_optimizer=distributed)
        optimizer = build_optimizer(models, clip_grad=1.0, use_distributed_optimizer=distributed, **optim)
        vocab = bridge.hf_config.vocab_size
        samples = [make_samples(vocab)[i] for i in shares[rank]]
        metrics = []
        for step in range(STEPS):
            arrays = TrainArrays()
            if settings.loss_type == "policy_loss":
                # derived per sample (seeded by its index), so every rank layout sees the same arrays
                logp = compute_log_probs(models, samples, vocab_size=vocab, micro_batch_size=2).log_probs
                for v, x in zip(logp, samples, strict=True):
                    x.rollout_log_probs = jitter(v, 0.3, seed=x.index).tolist()
                pairs = list(zip(logp, samples, strict=True))
                arrays = TrainArrays(old_log_probs=[jitter(v, 0.2, seed=1000 * (step + 1) + x.index) for v, x in pairs],
                                     ref_log_probs=[jitter(v, 1.0, seed=5000 + 1000 * step + x.index) for v, x in pairs])
            metrics.append(train_step(models, optimizer, samples, settings, vocab_size=vocab, arrays=arrays))
        weights = {name: tensor.detach().cpu().contiguous() for name, tensor in export_hf_weights(bridge, models)}
        slug = case.replace(" ", "_").replace(",", "")
        if rank == 0:
            save_file(weights, str(out_dir / f"{world_size}-{slug}.safetensors"))
        print(json.dumps({"case": case, "slug": slug, "rank": rank, "metrics": metrics}), flush=True)


if __name__ == "__main__":
    main()
    close_megatron()
