"""One rank of the routing-replay expert-parallel parity test (test_routing_replay.py starts it through
multirank.run_ranks), on moe_ep_parity.py's layout.

    python routing_replay_ep.py HF_DIR   (RANK, WORLD_SIZE, INIT_METHOD in the environment)

Two data-parallel ranks, each with half of the six samples and their replayed experts (random, distinct per
token: far from what the routers would choose), score them and take a policy-loss step with the experts
replayed, first with all 8 experts on every rank (EP 1), then split over the two (EP 2): each rank routes its own
tokens to global expert ids, which the alltoall dispatcher sends to the rank holding them. Every rank prints its
metrics, its samples' log-probs before and after the steps, and how many of its tokens a spy on the routers saw
routed elsewhere than the replayed ids.
"""

import json
import sys

import torch
from megatron.core import parallel_state
from multirank import rank_env
from parity_samples import make_samples
from routing_replay_run import Spy, mismatches, random_records, widths

from slime.backends.megatron import routing_replay
from slime.backends.megatron.bridge import build_model, close_megatron, init_megatron, make_bridge
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step

SETTINGS = StepSettings(loss_type="policy_loss", micro_batch_size=1, entropy_coef=0.01)


def run(hf_dir: str, ep: int, rank: int) -> dict:
    bridge = make_bridge(hf_dir, megatron={"moe_aux_loss_coeff": 0.01}, routing_replay=True)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    optimizer = build_optimizer(models, lr=1e-2, clip_grad=1.0, adam_eps=1e-3)
    routers = routing_replay.require_routers(models)
    vocab = bridge.hf_config.vocab_size
    every = make_samples(vocab)
    records = random_records(every, routers.num_layers, routers.num_experts, routers.topk)[3 * rank: 3 * rank + 3]
    samples = every[3 * rank: 3 * rank + 3]
    spy = Spy(models)
    parts = [[0], [1], [2]]
    old = compute_log_probs(models, samples, vocab_size=vocab, routed_experts=records).log_probs
    metrics = [train_step(models, optimizer, samples, SETTINGS, vocab_size=vocab,
                          arrays=TrainArrays(old_log_probs=old, routed_experts=records))]
    after = compute_log_probs(models, samples, vocab_size=vocab, routed_experts=records).log_probs
    calls = spy.take()  # the log-prob pass, the step, the last pass: 3 calls per micro-batch and layer
    bad = mismatches(calls, records, parts * 3, widths(samples, parts) * 3, routers.num_experts)
    local = len(models[0].module.decoder.layers[0].mlp.experts.local_experts)
    return {"rank": rank, "ep": ep, "local_experts": local, "metrics": metrics, "before": [v.tolist() for v in old],
            "log_probs": [v.tolist() for v in after], "replay_mismatches": bad}


def main() -> None:
    hf_dir = sys.argv[1]
    rank, world_size, init_method = rank_env()
    for ep in (1, 2):
        init_megatron(seed=0, rank=rank, world_size=world_size, init_method=init_method, expert_parallel=ep)
        print(json.dumps(run(hf_dir, ep, rank)), flush=True)
        parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
    close_megatron()
