"""Run in a subprocess by test_critic.py: the Megatron critic (value head) against the same critic
written by hand on the HF backbone, and a few value steps lowering the value loss.

    python value_parity.py HF_DIR   -> JSON lines: "values", "value step", "value training"
"""

import json
import sys
import tempfile

import torch
from megatron.core.utils import get_attr_wrapped_model
from parity_samples import make_samples, padded
from transformers import AutoModelForCausalLM

from slime.algorithms.policy_loss import value_loss
from slime.algorithms.reduce import sample_mean
from slime.backends.megatron.bridge import init_megatron, make_bridge
from slime.backends.megatron.checkpoint import iteration_dir, load_checkpoint, save_checkpoint
from slime.backends.megatron.critic import build_critic, compute_values
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.types import Sample

LR = 0.1
VALUE_CLIP = 0.05


class HFCritic(torch.nn.Module):
    """The hand-written critic: HF backbone (final norm included) and a hidden -> 1 linear head."""

    def __init__(self, hf_dir: str, head: torch.Tensor) -> None:
        super().__init__()
        self.backbone = AutoModelForCausalLM.from_pretrained(hf_dir).float().model
        self.backbone.get_input_embeddings().padding_idx = None  # Megatron trains the pad row too
        self.head = torch.nn.Linear(head.shape[1], 1, bias=False)
        self.head.weight.data.copy_(head)

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """V of response token t, read at the hidden state of the token before it."""
        out = []
        for x in samples:
            hidden = self.backbone(torch.tensor([x.tokens])).last_hidden_state[0]
            prompt = len(x.tokens) - x.response_length
            out.append(self.head(hidden[prompt - 1 : -1]).squeeze(-1))
        return out


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    bridge = make_bridge(hf_dir)
    critic = build_critic(bridge, hf_dir)
    head = get_attr_wrapped_model(critic[0], "output_layer").weight.detach().clone()
    samples = make_samples(bridge.hf_config.vocab_size, untrained=-1)
    values = compute_values(critic, samples, use_dynamic_batch_size=True, max_tokens_per_gpu=30)
    hf = HFCritic(hf_dir, head)
    with torch.no_grad():
        expected = hf.values(samples)
    print(json.dumps({"case": "values", "lengths": [len(v) for v in values], "head_shape": list(head.shape),
                      "gap": max((a - b).abs().max().item() for a, b in zip(values, expected, strict=True)),
                      "spread": float(torch.cat(values).std())}), flush=True)

    generator = torch.Generator().manual_seed(1)
    returns = [v + 0.2 * torch.randn(v.shape, generator=generator) for v in values]
    old_values = [v + 0.05 * torch.randn(v.shape, generator=generator) for v in values]
    arrays = TrainArrays(returns=returns, old_values=old_values)
    settings = StepSettings(loss_type="value_loss", micro_batch_size=2, value_clip=VALUE_CLIP)
    optimizer = build_optimizer(critic, lr=LR, clip_grad=1.0, optimizer="sgd")
    metrics = train_step(critic, optimizer, samples, settings, vocab_size=bridge.hf_config.vocab_size, arrays=arrays)
    # the same step by hand
    sgd = torch.optim.SGD(hf.parameters(), lr=LR)
    width = max(x.response_length for x in samples)
    mask = padded([x.loss_mask for x in samples], width).bool()
    out = value_loss(padded(hf.values(samples), width), padded(old_values, width), padded(returns, width), mask,
                     VALUE_CLIP)
    loss = sample_mean(out.loss, mask)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    sgd.step()
    with torch.no_grad():
        after_hf = hf.values(samples)
    after = compute_values(critic, samples, micro_batch_size=3)
    new_head = get_attr_wrapped_model(critic[0], "output_layer").weight.detach()
    print(json.dumps({"case": "value step", "megatron_loss": metrics["value_loss"], "hf_loss": float(loss.detach()),
                      "value_clipfrac": metrics["value_clipfrac"], "hf_clipfrac": float(sample_mean(out.clipfrac, mask)),
                      "head_gap": (new_head - hf.head.weight).abs().max().item(),
                      "head_moved": (new_head - head).abs().max().item(),
                      "values_gap": max((a - b).abs().max().item() for a, b in zip(after, after_hf, strict=True)),
                      "values_moved": max((a - b).abs().max().item() for a, b in zip(after, values, strict=True))}),
          flush=True)

    # a fresh critic trained on fixed targets: the value loss goes down
    critic = build_critic(bridge, hf_dir)
    optimizer = build_optimizer(critic, lr=3e-4, clip_grad=1.0)
    targets = TrainArrays(returns=[torch.full_like(v, 1.0) for v in values])
    losses = [train_step(critic, optimizer, samples, StepSettings(loss_type="value_loss", micro_batch_size=3,
                                                                   value_clip=10.0), vocab_size=bridge.hf_config.vocab_size,
                         arrays=targets)["value_loss"] for _ in range(6)]
    print(json.dumps({"case": "value training", "losses": losses}), flush=True)

    # the critic (value head included) survives a torch_dist checkpoint: a fresh critic with a new
    # random head loads it and takes the identical next step
    value_settings = StepSettings(loss_type="value_loss", micro_batch_size=3, value_clip=10.0)
    with tempfile.TemporaryDirectory() as save:
        save_checkpoint(critic, save, 6, optimizer=optimizer)
        before = compute_values(critic, samples)
        next_loss = train_step(critic, optimizer, samples, value_settings, vocab_size=bridge.hf_config.vocab_size,
                               arrays=targets)["value_loss"]
        restored = build_critic(bridge)
        restored_optimizer = build_optimizer(restored, lr=3e-4, clip_grad=1.0)
        fresh = compute_values(restored, samples)
        load_checkpoint(restored, iteration_dir(save, 6), restored_optimizer)
        loaded = compute_values(restored, samples)
        resumed_loss = train_step(restored, restored_optimizer, samples, value_settings,
                                  vocab_size=bridge.hf_config.vocab_size, arrays=targets)["value_loss"]
    print(json.dumps({"case": "critic checkpoint", "next_loss": next_loss, "resumed_loss": resumed_loss,
                      "loaded_gap": max((a - b).abs().max().item() for a, b in zip(before, loaded, strict=True)),
                      "fresh_gap": max((a - b).abs().max().item() for a, b in zip(before, fresh, strict=True))}),
          flush=True)


if __name__ == "__main__":
    main()
