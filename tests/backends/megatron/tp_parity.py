"""One rank of the tensor-parallel parity test (test_train_tp.py starts it through multirank.run_ranks).

    python tp_parity.py HF_DIR OUT_DIR   (RANK, WORLD_SIZE, INIT_METHOD in the environment)

All ranks form one tensor-parallel group (TP = world size, DP = 1): vocab-sharded logits. Prints the
response log-probs and entropies of `compute_log_probs`, takes one SGD policy step with entropy and KL
terms, and rank 0 writes the exported (TP-gathered) weights to OUT_DIR/tp<world>.safetensors.
"""

import json
import sys
from pathlib import Path

from dp_parity import jitter, make_samples
from multirank import rank_env
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


def main() -> None:
    hf_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world_size, init_method = rank_env()
    init_megatron(seed=0, tensor_parallel=world_size, rank=rank, world_size=world_size, init_method=init_method)
    bridge = make_bridge(hf_dir)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    vocab = bridge.hf_config.vocab_size
    samples = make_samples(vocab)
    scored = compute_log_probs(models, samples, vocab_size=vocab, temperature=0.8, with_entropy=True,
                               micro_batch_size=2)
    for v, x in zip(scored.log_probs, samples, strict=True):
        x.rollout_log_probs = jitter(v, 0.3, seed=x.index).tolist()
    arrays = TrainArrays(old_log_probs=[jitter(v, 0.2, seed=100 + x.index) for v, x in zip(scored.log_probs, samples,
                                                                                           strict=True)],
                         ref_log_probs=[jitter(v, 1.0, seed=200 + x.index) for v, x in zip(scored.log_probs, samples,
                                                                                           strict=True)])
    settings = StepSettings(loss_type="policy_loss", micro_batch_size=2, temperature=0.8, entropy_coef=0.1,
                            use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k3", use_tis=True, tis_clip=1.2,
                            tis_clip_low=0.8)
    optimizer = build_optimizer(models, lr=0.5, clip_grad=1.0, optimizer="sgd")
    metrics = train_step(models, optimizer, samples, settings, vocab_size=vocab, arrays=arrays)
    weights = {name: t.detach().cpu().contiguous() for name, t in export_hf_weights(bridge, models)}
    if rank == 0:
        save_file(weights, str(out_dir / f"tp{world_size}.safetensors"))
    print(json.dumps({"rank": rank, "log_probs": [v.tolist() for v in scored.log_probs],
                      "entropies": [v.tolist() for v in scored.entropies], "metrics": metrics}), flush=True)


if __name__ == "__main__":
    main()
    close_megatron()
