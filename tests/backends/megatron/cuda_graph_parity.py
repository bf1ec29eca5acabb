"""Run in a subprocess by test_cuda_graphs_gpu.py (CUDA): train steps of one model with megatron-core's local
CUDA graphs (`cuda_graph_impl=local`, slime/backends/megatron/cuda_graphs.py) against the same steps without.

    python cuda_graph_parity.py HF_DIR full|lora   -> one JSON line

Three models from the one checkpoint, each trained `STEPS` SFT steps on the same batch (4 micro-batches of
one shape): a plain one, a second plain one (how far two eager runs drift apart: flash attention's backward
is not bitwise deterministic), and one with graphs, built last (megatron keeps one set of graphs per
process). The line holds the three runs' losses and grad norms, how many graph replays the steps after the
first ran (`torch.cuda.CUDAGraph.replay` counted), the forward-only log-probs after training (run eagerly
by `cuda_graphs.eager`), and the message a step of another shape is refused with. `lora`: rank-8 adapters
on the frozen base (docs/lora.md), the launch-bound case graphs are for.
"""

import json
import statistics
import sys

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from slime.backends.megatron import cuda_graphs
from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.lora import LoraSpec, lora_callback
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.train import StepSettings, train_step
from slime.errors import ConfigError
from slime.types import Sample

STEPS = 4
MICRO = 2
GRAPHS = {"cuda_graph_impl": "local"}

REPLAYS = [0]
_replay = torch.cuda.CUDAGraph.replay


def _counted_replay(self: torch.cuda.CUDAGraph) -> None:
    REPLAYS[0] += 1
    _replay(self)


torch.cuda.CUDAGraph.replay = _counted_replay


def samples(vocab: int, length: int, seed: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    return [Sample(index=i, tokens=torch.randint(0, vocab, (length,), generator=generator).tolist(),
                   response_length=length // 2) for i in range(4 * MICRO)]


def step_grads(models: list) -> dict[str, torch.Tensor]:
    """Each trainable parameter's gradient of the step just taken (megatron DDP's `main_grad`, still holding it
    until the next step zeroes it), divided by the norm of them all, so that a factor every gradient of a run
    shares (clipping scales them in place) drops out of a comparison between runs."""
    grads = {name: param.main_grad.detach().float().cpu()
             for name, param in models[0].named_parameters() if param.requires_grad}
    total = torch.stack([g.norm() for g in grads.values()]).norm()
    return {name: g / total for name, g in grads.items()}


def grad_gaps(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter, |a - b| / |b| of the normalised gradients: bf16 rounding moves it by ~1e-2 at most, a
    gradient missing, counted twice or taken from stale memory by ~1 or more."""
    assert a.keys() == b.keys()
    return {name: ((a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-30)).item() for name in b}


def run(hf_dir: str, mode: str, megatron: dict) -> dict:
    init_megatron(seed=0, megatron=megatron)
    bridge = make_bridge(hf_dir, torch.bfloat16, megatron=megatron)
    spec = LoraSpec(rank=8, alpha=16.0, dropout=0.0, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    models = build_model(bridge, hf_dir, wrap_with_ddp=True, post_create=lora_callback(spec) if mode == "lora" else None)
    optimizer = build_optimizer(models, lr=1e-3, clip_grad=1.0, bf16=True)
    vocab = bridge.hf_config.vocab_size
    batch = samples(vocab, 64, seed=0)
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=MICRO)
    losses, norms, replays = [], [], []
    for step in range(STEPS):
        before = REPLAYS[0]
        metrics = train_step(models, optimizer, batch, settings, vocab_size=vocab)
        torch.cuda.synchronize()
        losses.append(metrics["sft_loss"])
        norms.append(metrics["grad_norm"])
        replays.append(REPLAYS[0] - before)
        if step == 1:  # the first replayed step, from the weights the eager first step left: identical in every run
            grads = step_grads(models)
    before = REPLAYS[0]
    logp = compute_log_probs(models, batch, vocab_size=vocab, micro_batch_size=MICRO).log_probs
    refused = None
    try:
        train_step(models, optimizer, samples(vocab, 96, seed=1), settings, vocab_size=vocab)
    except ConfigError as exc:
        refused = str(exc)
    # TransformerBlock holds a manager too under cuda_graph_impl=local, used only for inference decode with
    # cuda_graph_scope=full_iteration (never in training): count the transformer layers' managers
    layers = [m for m in models[0].modules() if isinstance(m, TransformerLayer) and hasattr(m, "cudagraph_manager")]
    return {"losses": losses, "grad_norms": norms, "grads": grads, "replays": replays, "logprob_replays": REPLAYS[0] - before,
            "log_probs": torch.cat([torch.as_tensor(x, dtype=torch.float32) for x in logp]), "refused": refused,
            "graph_layers": len(layers), "enabled": cuda_graphs.enabled(models),
            "layers": bridge.hf_config.num_hidden_layers}


def worst(gaps: dict[str, float], count: int = 5) -> dict[str, float]:
    """The `count` largest gaps by parameter name."""
    return dict(sorted(gaps.items(), key=lambda item: -item[1])[:count])


def main() -> None:
    hf_dir, mode = sys.argv[1], sys.argv[2]
    plain = run(hf_dir, mode, {})
    again = run(hf_dir, mode, {})
    graphed = run(hf_dir, mode, GRAPHS)

    def gap(a: dict, b: dict, key: str) -> float:
        return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a[key], b[key], strict=True))

    print(json.dumps({
        "mode": mode, "device": torch.cuda.get_device_name(), "steps": STEPS, "micro_batches": 4,
        "layers": graphed["layers"], "graph_layers": graphed["graph_layers"], "enabled": graphed["enabled"],
        "plain_enabled": plain["enabled"], "plain_losses": plain["losses"], "graph_losses": graphed["losses"],
        "plain_grad_norms": plain["grad_norms"], "graph_grad_norms": graphed["grad_norms"],
        "loss_gap": gap(graphed, plain, "losses"), "rerun_loss_gap": gap(again, plain, "losses"),
        "norm_gap": gap(graphed, plain, "grad_norms"), "rerun_norm_gap": gap(again, plain, "grad_norms"),
        "param_grad_gaps": worst(grad_gaps(graphed["grads"], plain["grads"])),
        "rerun_param_grad_gaps": worst(grad_gaps(again["grads"], plain["grads"])),
        "median_param_grad_gap": statistics.median(grad_gaps(graphed["grads"], plain["grads"]).values()),
        "first_loss_gap": abs(graphed["losses"][0] - plain["losses"][0]) / abs(plain["losses"][0]),
        "replays": graphed["replays"], "plain_replays": plain["replays"],
        "logprob_replays": graphed["logprob_replays"],
        "logprob_gap": (graphed["log_probs"] - plain["log_probs"]).abs().max().item(),
        "rerun_logprob_gap": (again["log_probs"] - plain["log_probs"]).abs().max().item(),
        "refused": graphed["refused"], "plain_refused": plain["refused"]}), flush=True)


if __name__ == "__main__":
    main()
