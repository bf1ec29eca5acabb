"""Run in a subprocess by test_moe.py: the Qwen3-MoE model's options from the config tree, train steps, the
router's auxiliary losses and the LoRA refusal (fp32, CPU, one rank).

    python moe_train.py HF_DIR   -> one JSON line per case ("options", "steps", "grads", "lora")
"""

import json
import sys

import torch
from mbridge.core.util import unwrap_model
from parity_samples import make_samples

from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.lora import LoraSpec, lora_callback
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.train import StepSettings, train_step
from slime.config import load_config
from slime.errors import ConfigError

SFT = StepSettings(loss_type="sft_loss", micro_batch_size=2)


def options(hf_dir: str) -> dict:
    """The megatron options as a command line gives them, through load_config, into the model's config."""
    config = load_config(None, ["--hf-checkpoint", hf_dir, "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff",
                                "0.001", "--moe-router-topk", "2", "--num-experts", "8"])
    tc = make_bridge(hf_dir, megatron=config.megatron).config
    refused = []
    for bad in ({"moe_router_topk": 4}, {"num_experts": 16}, {"moe_grouped_gemm": True},
                {"moe_aux_loss_coeff": 0.1, "moe_router_load_balancing_type": "none"}):
        try:
            make_bridge(hf_dir, megatron=bad)
        except ConfigError as e:
            refused.append(str(e))
    fields = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type", "num_moe_experts",
              "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_token_dispatcher_type",
              "moe_grouped_gemm", "moe_expert_capacity_factor", "moe_router_dtype")
    return {"case": "options", "megatron": config.megatron, **{f: getattr(tc, f) for f in fields},
            "refused": refused}


def steps(hf_dir: str) -> dict:
    """Five Adam steps of SFT on one batch: the loss falls, and every expert of the last layer moves; then a
    reference model of the same bridge, built after the optimizer, holds the HF weights."""
    bridge = make_bridge(hf_dir)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    optimizer = build_optimizer(models, lr=1e-2, clip_grad=1.0)
    vocab = bridge.hf_config.vocab_size
    samples = make_samples(vocab)
    layer = unwrap_model(models[0]).decoder.layers[-1].mlp
    before = [e.linear_fc1.weight.detach().clone() for e in layer.experts.local_experts]
    losses = [train_step(models, optimizer, samples, SFT, vocab_size=vocab)["loss"] for _ in range(5)]
    moved = [(e.linear_fc1.weight - b).abs().max().item() for e, b in zip(layer.experts.local_experts, before,
                                                                          strict=True)]
    # a second model of the same bridge once the optimizer exists, as the RL train actor builds its reference
    reference = unwrap_model(build_model(bridge, hf_dir)[0]).decoder.layers[-1].mlp.experts.local_experts
    reference_is_hf = all(e.linear_fc1.weight.equal(b) for e, b in zip(reference, before, strict=True))
    return {"case": "steps", "losses": losses, "expert_moved": moved, "reference_is_hf": reference_is_hf}


def grads(hf_dir: str) -> dict:
    """One SFT step's gradients without an auxiliary loss, with the load-balancing loss and with the z-loss."""
    out = {"case": "grads"}
    for name, megatron in (("none", {}), ("aux", {"moe_aux_loss_coeff": 0.1}), ("z", {"moe_z_loss_coeff": 0.1})):
        bridge = make_bridge(hf_dir, megatron=megatron)
        models = build_model(bridge, hf_dir, wrap_with_ddp=True)
        optimizer = build_optimizer(models, lr=0.0, clip_grad=0.0, optimizer="sgd")
        vocab = bridge.hf_config.vocab_size
        metrics = train_step(models, optimizer, make_samples(vocab), SFT, vocab_size=vocab)
        layers = unwrap_model(models[0]).decoder.layers
        out[name] = {"loss": metrics["loss"],
                     "router": [layer.mlp.router.weight.main_grad.clone() for layer in layers],
                     "last_experts": [e.linear_fc2.weight.main_grad.clone()
                                      for e in layers[-1].mlp.experts.local_experts]}
    base = out["none"]
    for name in ("aux", "z"):
        row = out[name]
        out[name] = {"loss": row["loss"],
                     "router_gap": [(a - b).abs().max().item() for a, b in zip(row["router"], base["router"],
                                                                               strict=True)],
                     "router_norm": [g.norm().item() for g in base["router"]],
                     "last_experts_gap": max((a - b).abs().max().item() for a, b in
                                             zip(row["last_experts"], base["last_experts"], strict=True))}
    out["none"] = {"loss": base["loss"]}
    return out


def lora(hf_dir: str) -> dict:
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("linear_qkv",))
    try:
        build_model(make_bridge(hf_dir), hf_dir, wrap_with_ddp=True, post_create=lora_callback(spec))
    except ConfigError as e:
        return {"case": "lora", "refused": str(e)}
    return {"case": "lora", "refused": None}


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    torch.manual_seed(0)
    for case in (options, steps, grads, lora):
        print(json.dumps(case(hf_dir)), flush=True)


if __name__ == "__main__":
    main()
