"""Run in a subprocess by test_train_gpu.py: Megatron train steps of a random 0.5B Qwen2 on CUDA (bf16).

Prints one JSON line: SFT losses over repeated steps on one batch, a policy-loss step's metrics, and
whether the exported HF weights have the HF model's names and shapes.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from slime.backends.megatron.bridge import build_model, export_hf_weights, init_megatron, make_bridge
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.train import StepSettings, train_step
from slime.types import Sample


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    bridge = make_bridge(hf_dir, torch.bfloat16)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    optimizer = build_optimizer(models, lr=1e-4, clip_grad=1.0, bf16=True)
    vocab = bridge.hf_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, vocab, (512,), generator=generator).tolist(),
                      response_length=256, loss_mask=[1] * 256) for i in range(8)]
    sft = StepSettings(loss_type="sft_loss", micro_batch_size=4)
    losses = [train_step(models, optimizer, samples, sft, vocab_size=vocab)["sft_loss"] for _ in range(4)]
    for i, sample in enumerate(samples):
        sample.rollout_log_probs = [-12.0] * sample.response_length
        sample.metadata = {"advantage": 1.0 if i % 2 else -1.0}
    policy = train_step(models, optimizer, samples, StepSettings(loss_type="policy_loss", micro_batch_size=2),
                        vocab_size=vocab)
    exported = {name: tuple(t.shape) for name, t in export_hf_weights(bridge, models)}
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, device_map="meta")
    expected = {name: tuple(t.shape) for name, t in reference.state_dict().items() if name != "lm_head.weight"}
    print(json.dumps({"device": torch.cuda.get_device_name(), "sft_losses": losses,
                      "policy": {k: v for k, v in policy.items() if isinstance(v, float)},
                      "export_matches_hf": exported == expected, "exported_tensors": len(exported)}), flush=True)


if __name__ == "__main__":
    main()
