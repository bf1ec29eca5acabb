"""Run in a subprocess by test_glm4_moe.py: the tiny GLM-4.5 (glm4_moe) through mbridge and megatron-core (fp32,
CPU, one rank).

    python glm4_moe_run.py HF_DIR CASE...   -> one JSON line per case (test_glm4_moe.py runs two such scripts at once)

Cases: "parity" (response log-probs and entropies against HF's, then the same with one GLM-4.5 trait of the
router or the rotary embedding taken out: each must move them far above the tolerance), "options" (slime's GLM-4.5
flags on the command line reach the TransformerConfig; flags contradicting the checkpoint are refused), "steps"
(SFT and GRPO steps; the expert bias kept by default, moved by --moe-router-bias-update-rate, exported as
e_score_correction_bias), "mtp" (a checkpoint with an MTP layer: skipped at load with one log line, carried
unchanged by the export stage; case "mtp=MTP_HF_DIR,WORK_DIR"), "lora" (refused on MoE models).
"""

import json
import logging
import sys

import torch
from mbridge.core.util import unwrap_model
from moe_train import SFT, lora  # the Qwen3-MoE rank script's SFT step and LoRA refusal case
from parity_samples import make_samples
from transformers import AutoModelForCausalLM

from slime.backends.megatron.bridge import build_model, export_hf_weights, init_megatron, make_bridge
from slime.backends.megatron.logprobs import compute_log_probs, pad_samples, response_log_probs
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.config import load_config
from slime.errors import ConfigError
from slime.types import Sample

GRPO = StepSettings(loss_type="policy_loss", micro_batch_size=2, advantage_estimator="grpo")
# slime's scripts/models/glm4.5-355B-A32B.sh MODEL_ARGS with the tiny model's shape (1 dense + 2 MoE layers)
SLIME_FLAGS = ["--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "4",
               "--num-query-groups", "2", "--kv-channels", "16", "--num-layers", "3", "--hidden-size", "64",
               "--ffn-hidden-size", "128", "--add-qkv-bias", "--normalization", "RMSNorm", "--position-embedding-type",
               "rope", "--rotary-percent", "0.5", "--swiglu", "--untie-embeddings-and-output-weights",
               "--rotary-base", "1000000", "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
               "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-bias-update-rate", "0", "--moe-router-load-balancing-type", "seq_aux_loss",
               "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "2", "--moe-router-topk-scaling-factor",
               "2.5", "--moe-layer-freq", "[0]*1+[1]*2", "--num-experts", "8", "--moe-router-dtype", "fp32",
               "--moe-aux-loss-coeff", "0", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]


def hf_gaps(model, hf, samples: list[Sample], vocab: int) -> tuple[float, float]:
    """(max |log-prob gap|, max |entropy gap|) of the Megatron model against HF over the response tokens."""
    temperature = 0.7
    with torch.no_grad():
        logp, _, entropy = response_log_probs(model, pad_samples(samples), vocab_size=vocab, temperature=temperature,
                                              with_entropy=True)
        gaps, entropy_gaps = [], []
        for row, sample in enumerate(samples):
            scores = hf(torch.tensor([sample.tokens])).logits[0].float() / temperature
            prompt, n = len(sample.tokens) - sample.response_length, sample.response_length
            expected = torch.log_softmax(scores[prompt - 1: -1], -1)
            ref = expected.gather(1, torch.tensor(sample.tokens[prompt:]).unsqueeze(1)).squeeze(1)
            gaps.append((logp[row, :n] - ref).abs().max().item())
            entropy_gaps.append((entropy[row, :n] + (expected.exp() * expected).sum(-1)).abs().max().item())
    return max(gaps), max(entropy_gaps)


def parity(hf_dir: str) -> dict:
    bridge = make_bridge(hf_dir)
    model = build_model(bridge, hf_dir)[0].eval()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i, (prompt_len, response_len) in enumerate([(5, 9), (12, 3), (1, 14), (20, 6), (9, 12)]):
        tokens = torch.randint(0, vocab, (prompt_len + response_len,), generator=generator).tolist()
        samples.append(Sample(index=i, tokens=tokens, response_length=response_len))
    gap, entropy_gap = hf_gaps(model, hf, samples, vocab)
    layers = unwrap_model(model).decoder.layers
    out = {"case": "parity", "max_gap": gap, "entropy_gap": entropy_gap, "padded_vocab": bridge.padded_vocab_size,
           "dense_layers": [i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "router")],
           "shared_experts": [hasattr(layer.mlp, "shared_experts") and layer.mlp.shared_experts is not None
                              for layer in layers]}
    # each trait taken out of the routers (they read the config at every forward), then put back
    config, ablations = bridge.config, {}
    for name, changes in (("no_groups", {"moe_router_num_groups": None, "moe_router_group_topk": None}),
                          ("no_scaling", {"moe_router_topk_scaling_factor": None})):
        saved = {k: getattr(config, k) for k in changes}
        for k, v in changes.items():
            setattr(config, k, v)
        ablations[name] = hf_gaps(model, hf, samples, vocab)[0]
        for k, v in saved.items():
            setattr(config, k, v)
    biases = [layer.mlp.router.expert_bias for layer in layers if hasattr(layer.mlp, "router")]
    saved_bias = [b.clone() for b in biases]
    for b in biases:
        b.zero_()
    ablations["no_expert_bias"] = hf_gaps(model, hf, samples, vocab)[0]
    for b, s in zip(biases, saved_bias, strict=True):
        b.copy_(s)
    assert hf_gaps(model, hf, samples, vocab)[0] == gap  # all put back
    # every dimension rotated: a model built with rotary_percent 1 (mbridge reads the HF field at build)
    bridge.hf_config.partial_rotary_factor = 1.0
    ablations["full_rotary"] = hf_gaps(build_model(bridge, hf_dir)[0].eval(), hf, samples, vocab)[0]
    bridge.hf_config.partial_rotary_factor = 0.5
    return {**out, "ablations": ablations}


def options(hf_dir: str) -> dict:
    config = load_config(None, ["--hf-checkpoint", hf_dir, *SLIME_FLAGS])
    tc = make_bridge(hf_dir, megatron=config.megatron).config
    fields = ("moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_router_score_function",
              "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_topk_scaling_factor",
              "moe_router_num_groups", "moe_router_group_topk", "qk_layernorm", "add_qkv_bias", "moe_router_topk",
              "moe_ffn_hidden_size", "num_moe_experts", "ffn_hidden_size", "moe_router_load_balancing_type",
              "moe_aux_loss_coeff", "moe_grouped_gemm", "moe_shared_expert_overlap", "moe_router_dtype")
    refused = {}
    for flag, value in (("--rotary-percent", "1.0"), ("--moe-layer-freq", "[1]*3"),
                        ("--moe-router-topk-scaling-factor", "1.0"), ("--moe-router-num-groups", "4"),
                        ("--moe-router-enable-expert-bias", "false"), ("--moe-router-score-function", "softmax"),
                        ("--moe-shared-expert-intermediate-size", "64")):
        try:
            make_bridge(hf_dir, megatron=load_config(None, [flag, value]).megatron)
            refused[flag] = None
        except ConfigError as e:
            refused[flag] = str(e)
    rate = make_bridge(hf_dir, megatron=load_config(None, ["--moe-router-bias-update-rate", "0.001"]).megatron).config
    seq = make_bridge(hf_dir, megatron={"moe_aux_loss_coeff": 0.01}).config
    return {"case": "options", "megatron": config.megatron, **{f: getattr(tc, f) for f in fields},
            "refused": refused, "given_rate": rate.moe_router_bias_update_rate,
            "aux_type": seq.moe_router_load_balancing_type}


def _biases(models) -> list[torch.Tensor]:
    return [layer.mlp.router.expert_bias.detach().clone() for layer in unwrap_model(models[0]).decoder.layers
            if hasattr(layer.mlp, "router")]


def steps(hf_dir: str) -> dict:
    """SFT steps lower the loss; GRPO steps train the dense layer, routers, experts and shared experts; the expert
    bias stays with the default rate 0 and moves by +-rate per step with --moe-router-bias-update-rate."""
    out = {"case": "steps"}
    bridge = make_bridge(hf_dir)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    vocab = bridge.hf_config.vocab_size
    optimizer = build_optimizer(models, lr=1e-2, clip_grad=1.0)
    out["sft_losses"] = [train_step(models, optimizer, make_samples(vocab), SFT, vocab_size=vocab)["loss"]
                         for _ in range(4)]
    for name, megatron in (("default", {}), ("rate", {"moe_router_bias_update_rate": 0.01})):
        bridge = make_bridge(hf_dir, megatron=megatron)
        models = build_model(bridge, hf_dir, wrap_with_ddp=True)
        optimizer = build_optimizer(models, lr=1e-3, clip_grad=1.0, adam_eps=1e-3)
        samples = make_samples(vocab)
        named = dict(unwrap_model(models[0]).named_parameters())
        before = {k: v.detach().clone() for k, v in named.items()}
        bias0 = _biases(models)
        metrics, moves = [], []
        for _ in range(2):
            old = compute_log_probs(models, samples, vocab_size=vocab).log_probs
            previous = _biases(models)
            metrics.append(train_step(models, optimizer, samples, GRPO, vocab_size=vocab,
                                      arrays=TrainArrays(old_log_probs=old)))
            moves.append(sorted({round(float(d), 6) for a, b in zip(_biases(models), previous, strict=True)
                                 for d in (a - b).abs().flatten()}))
        groups = {"dense_mlp": "layers.0.mlp.linear_fc", "router": "mlp.router.weight",
                  "experts": "mlp.experts.local_experts", "shared_experts": "mlp.shared_experts",
                  "qkv_bias": "linear_qkv.bias", "q_norm": "q_layernorm"}
        moved = {g: max((named[k] - before[k]).abs().max().item() for k in named if key in k)
                 for g, key in groups.items()}
        exported = dict(export_hf_weights(bridge, models))
        after = _biases(models)
        out[name] = {"metrics": metrics, "bias_moves": moves, "moved": moved,
                     "bias_changed": max((a - b).abs().max().item() for a, b in zip(after, bias0, strict=True)),
                     "exported_bias_equal": all(torch.equal(exported[f"model.layers.{i + 1}.mlp.gate."
                                                                     "e_score_correction_bias"], b)
                                                for i, b in enumerate(after)),
                     "rate": bridge.config.moe_router_bias_update_rate}
    return out


def mtp(hf_dir: str, work: str) -> dict:
    from slime.stages.convert import run_convert
    from slime.stages.export import run_export

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("slime.backends.megatron.glm4_moe").addHandler(handler)
    logging.getLogger("slime.backends.megatron.glm4_moe").setLevel(logging.INFO)
    config = load_config(None, ["--hf-checkpoint", hf_dir, "--save", f"{work}/ckpt", "--load", f"{work}/ckpt",
                                "--output-dir", f"{work}/hf"])
    run_convert(config)
    exported = run_export(config)
    return {"case": "mtp", "logs": [r for r in records if "MTP" in r], "export": exported["hf_dir"],
            "carried": exported.get("carried_from_origin")}


def main() -> None:
    hf_dir, cases = sys.argv[1], sys.argv[2:]
    init_megatron(seed=0)
    torch.manual_seed(0)
    for case in cases:
        if case.startswith("mtp="):  # mtp=MTP_HF_DIR,WORK_DIR
            print(json.dumps(mtp(*case.removeprefix("mtp=").split(","))), flush=True)
        else:
            print(json.dumps({"parity": parity, "options": options, "steps": steps, "lora": lora}[case](hf_dir)),
                  flush=True)


if __name__ == "__main__":
    main()
