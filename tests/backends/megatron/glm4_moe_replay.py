"""Run in a subprocess by test_glm4_moe.py: rollout routing replay (R3) on the tiny GLM-4.5 narrows the gap between
the trainer's log-probs and the rollout's, as engine_gap.py measures it for Qwen3-MoE with the built-in engine.

    python glm4_moe_replay.py HF_DIR [NOISE]   -> one JSON line

The rollout here is transformers' Glm4MoeForCausalLM on a copy of the checkpoint whose router weights carry relative
noise NOISE (default 0.1; engine_gap.engine_dir), as a real engine routes a little differently from the trainer: it samples
the responses, and a teacher-forced pass over each sample gives its log-probs and the experts each fed token went to
in every layer (hooks on the routers), written as the engines write them: [len(tokens) - 1, num_layers, topk] with -1
in the dense layer 0, which has no router. The trainer (megatron-core, fp32, the unperturbed weights) then scores and
trains on the same samples without and with R3.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from engine_gap import engine_dir, replay_gaps
from transformers import AutoModelForCausalLM

from slime.backends.megatron.bridge import init_megatron
from slime.types import Sample

PROMPTS, NEW_TOKENS = 8, 24


def rollout(model_dir: str) -> list[Sample]:
    """PROMPTS sampled responses with the rollout's log-probs and routed experts."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = hf.config
    routed: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: routed.__setitem__(i, out[2].detach()))
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(2)
    samples = []
    with torch.no_grad():
        for i in range(PROMPTS):
            prompt = torch.randint(0, config.vocab_size, (3 + i % 4,), generator=generator).tolist()
            tokens = hf.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)[0].tolist()
            routed.clear()
            logits = hf(torch.tensor([tokens[:-1]])).logits[0].float()
            logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)
            record = torch.full((len(tokens) - 1, config.num_hidden_layers, config.num_experts_per_tok), -1,
                                dtype=torch.int32)
            for layer, ids in routed.items():
                record[:, layer] = ids.int()
            n = len(tokens) - len(prompt)
            samples.append(Sample(index=i, tokens=tokens, response_length=n, loss_mask=[1] * n,
                                  rollout_log_probs=logp[-n:].tolist(), rollout_routed_experts=record.view(
                                      len(tokens) - 1, -1).tolist(), metadata={"advantage": float(i % 3) - 1.0}))
    return samples


def main() -> None:
    hf_dir = sys.argv[1]
    noise = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    init_megatron(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        samples = rollout(engine_dir(hf_dir, Path(tmp) / "engine", noise))
    out = {"noise": noise, "dense_layer_ids": sorted({row[j] for s in samples for row in s.rollout_routed_experts
                                                      for j in range(2)}), **replay_gaps(hf_dir, samples)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
