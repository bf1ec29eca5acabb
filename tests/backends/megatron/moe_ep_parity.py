"""One rank of the expert-parallel parity test (test_moe.py starts it through multirank.run_ranks).

    python moe_ep_parity.py HF_DIR OUT_DIR [MEGATRON_JSON]   (RANK, WORLD_SIZE, INIT_METHOD in the environment)

Two data-parallel ranks, each with half of the same six samples (three micro-batches each: with expert
parallelism every rank of an expert group must run as many as the others), take two policy-loss steps
(Adam, the load-balancing and z losses on), first with all 8 experts of each layer on every rank (EP 1), then
with them split over the two (EP 2, 4 each). For each, every rank prints its metrics and its samples' log-probs
after the steps (MEGATRON_JSON: other megatron options than MEGATRON's), and rank 0 writes the exported HF weights to OUT_DIR/ep<EP>.safetensors. Then a forward-only pass with unequal shares (4 and 2
micro-batches), which expert parallelism refuses on both ranks instead of hanging.
"""

import json
import sys
from pathlib import Path

import torch
from megatron.core import parallel_state
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
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.errors import ConfigError

MEGATRON = {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
SETTINGS = StepSettings(loss_type="policy_loss", micro_batch_size=1, entropy_coef=0.01)


def run(hf_dir: str, out_dir: Path, ep: int, rank: int, megatron: dict) -> dict:
    """Build, train and score with the experts split over `ep` ranks (megatron's parallel state for it)."""
    bridge = make_bridge(hf_dir, megatron=megatron)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    optimizer = build_optimizer(models, lr=1e-2, clip_grad=1.0, adam_eps=1e-3)
    vocab = bridge.hf_config.vocab_size
    samples = make_samples(vocab)[3 * rank: 3 * rank + 3]
    moe_layer = next(layer for layer in models[0].module.decoder.layers if hasattr(layer.mlp, "experts"))
    local_experts = len(moe_layer.mlp.experts.local_experts)
    metrics = []
    for _ in range(2):
        old = compute_log_probs(models, samples, vocab_size=vocab).log_probs
        metrics.append(train_step(models, optimizer, samples, SETTINGS, vocab_size=vocab,
                                  arrays=TrainArrays(old_log_probs=old)))
    after = compute_log_probs(models, samples, vocab_size=vocab).log_probs
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in export_hf_weights(bridge, models)}
    if rank == 0:
        save_file(weights, str(out_dir / f"ep{ep}.safetensors"))
    try:  # unequal shares: rank 0 would run 4 micro-batches, rank 1 two
        compute_log_probs(models, make_samples(vocab)[:4] if rank == 0 else samples[:2], vocab_size=vocab)
        refused = None
    except ConfigError as e:
        refused = str(e)
    return {"rank": rank, "ep": ep, "local_experts": local_experts, "metrics": metrics,
            "log_probs": [v.tolist() for v in after], "exported": len(weights), "refused": refused}


def main() -> None:
    hf_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    megatron = json.loads(sys.argv[3]) if len(sys.argv) > 3 else MEGATRON
    rank, world_size, init_method = rank_env()
    for ep in (1, 2):  # one process group, megatron's groups made anew for each layout
        init_megatron(seed=0, rank=rank, world_size=world_size, init_method=init_method, expert_parallel=ep)
        print(json.dumps(run(hf_dir, out_dir, ep, rank, megatron)), flush=True)
        parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
    close_megatron()
