"""Run in a subprocess by test_logprobs.py: Megatron response log-probs vs HF teacher-forced ones.

    python logprob_parity.py HF_DIR   -> prints one JSON line {max_gap, entropy_gap, ...}
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.logprobs import pad_samples, response_log_probs
from slime.types import Sample


def main() -> None:
    hf_dir = sys.argv[1]
    init_megatron(seed=0)
    bridge = make_bridge(hf_dir)
    model = build_model(bridge, hf_dir)[0].eval()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i, (prompt_len, response_len) in enumerate([(5, 9), (12, 3), (1, 14), (7, 0), (20, 6)]):
        tokens = torch.randint(0, vocab, (prompt_len + response_len,), generator=generator).tolist()
        samples.append(Sample(index=i, tokens=tokens, response_length=response_len))
    temperature = 0.7
    with torch.no_grad():
        logp, mask, entropy = response_log_probs(model, pad_samples(samples), vocab_size=vocab,
                                                 temperature=temperature, with_entropy=True)
        gaps, entropy_gaps = [], []
        for row, sample in enumerate(samples):
            ids = torch.tensor([sample.tokens])
            scores = hf(ids).logits[0].float() / temperature  # [L, V]
            prompt = len(sample.tokens) - sample.response_length
            expected = torch.log_softmax(scores[prompt - 1 : -1], -1)
            targets = torch.tensor(sample.tokens[prompt:])
            ref = expected.gather(1, targets.unsqueeze(1)).squeeze(1)
            ref_entropy = -(expected.exp() * expected).sum(-1)
            n = sample.response_length
            assert int(mask[row].sum()) == n
            if n:
                gaps.append((logp[row, :n] - ref).abs().max().item())
                entropy_gaps.append((entropy[row, :n] - ref_entropy).abs().max().item())
            assert bool((logp[row, n:] == 0).all())
    print(json.dumps({"max_gap": max(gaps), "entropy_gap": max(entropy_gaps), "vocab": vocab,
                      "padded_vocab": bridge.padded_vocab_size}), flush=True)


if __name__ == "__main__":
    main()
