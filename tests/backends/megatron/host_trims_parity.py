"""Run in a subprocess by test_host_trims.py: a tiny random bf16 Qwen2 trained two SFT steps and scored by
`compute_log_probs`, once with host_trims installed and once with megatron's originals, from the same weights:
losses, grad norms, updated weights and log-probs compared bit for bit; the trims' effects (no tp_group
DeprecationWarning, megatron's undecorated backward called, its identity region Functions not called) recorded.

    python host_trims_parity.py DTYPE [LORA_RANK]   -> one JSON line (DTYPE bf16 or fp32; LORA_RANK > 0: the model
                                                       with LoRA adapters on its frozen linear layers)
"""

import json
import sys
import tempfile
import warnings

import torch
from transformers import Qwen2Config

from slime.backends.megatron import host_trims
from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.lora import LoraSpec, lora_callback
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.train import StepSettings, train_step
from slime.types import Sample


def main() -> None:
    dtype = torch.bfloat16 if sys.argv[1] == "bf16" else torch.float32
    rank = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    spec = LoraSpec(rank=rank, alpha=2.0 * rank, dropout=0.0,
                    targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) if rank else None
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
                         max_position_embeddings=256)
    init_megatron(seed=0)
    with tempfile.TemporaryDirectory() as hf_dir:
        config.save_pretrained(hf_dir)
        bridge = make_bridge(hf_dir, dtype)
        models = build_model(bridge, wrap_with_ddp=True, post_create=lora_callback(spec))
    start = [p.detach().clone() for p in models[0].parameters()]
    generator = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, 512, (12 + 3 * i,), generator=generator).tolist(),
                      response_length=8 + 2 * i) for i in range(4)]
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=2)
    calls = {}

    def counted(key):
        undecorated = host_trims._ORIGINAL[key].__wrapped__

        def call(*args, **kwargs):
            calls[key] += 1
            return undecorated(*args, **kwargs)
        return call

    for key in ("backward", "frozen_backward"):  # what lean_backward / lean_frozen_backward call directly
        host_trims._ORIGINAL[key].__wrapped__ = counted(key)

    def counting(key):
        original = host_trims._ORIGINAL[key]

        def call(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        return call

    for key in ("copy_to", "reduce_from"):  # megatron's identity autograd Functions at one tensor-parallel rank
        host_trims._ORIGINAL[key] = counting(key)
    out = {}
    for trims in (True, False):
        host_trims.install(trims)
        calls.update(backward=0, frozen_backward=0, copy_to=0, reduce_from=0)
        with torch.no_grad():
            for param, value in zip(models[0].parameters(), start, strict=True):
                param.copy_(value)
        optimizer = build_optimizer(models, lr=1e-3, clip_grad=1.0, bf16=dtype is torch.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = [train_step(models, optimizer, samples, settings, vocab_size=512) for _ in range(2)]
        logp = compute_log_probs(models, samples, vocab_size=512, micro_batch_size=2).log_probs
        out[trims] = {"metrics": metrics, "params": [p.detach().clone() for p in models[0].parameters()],
                      "logp": logp, "installed": host_trims.installed(), "lean_calls": calls["backward"], "lean_frozen_calls": calls["frozen_backward"],
                      "region_calls": calls["copy_to"] + calls["reduce_from"],
                      "tp_warnings": sum("tp_group is None" in str(w.message) for w in caught)}
    on, off = out[True], out[False]
    print(json.dumps({
        "installed": [on["installed"], off["installed"]], "lean_calls": [on["lean_calls"], off["lean_calls"]],
        "lean_frozen_calls": [on["lean_frozen_calls"], off["lean_frozen_calls"]],
        "tp_warnings": [on["tp_warnings"], off["tp_warnings"]],
        "region_calls": [on["region_calls"], off["region_calls"]],
        "losses": [[m["sft_loss"] for m in on["metrics"]], [m["sft_loss"] for m in off["metrics"]]],
        "grad_norms": [[m["grad_norm"] for m in on["metrics"]], [m["grad_norm"] for m in off["metrics"]]],
        "params_identical": all(torch.equal(a, b) for a, b in zip(on["params"], off["params"], strict=True)),
        "params_changed": sum(int(not torch.equal(a, b)) for a, b in zip(on["params"], start, strict=True)),
        "logp_identical": all(torch.equal(a, b) for a, b in zip(on["logp"], off["logp"], strict=True))}),
        flush=True)


if __name__ == "__main__":
    main()
