"""Run in a subprocess by test_attention.py: SDPAttention vs megatron-core's DotProductAttention.

Prints one JSON line per case with the largest output and input-gradient differences.
"""

import json
import sys

import torch

from slime.backends.megatron.bridge import init_megatron, make_bridge


def compare(case: str, heads: int, groups: int, explicit_mask: bool) -> dict:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from slime.backends.megatron.attention import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=16 * heads, num_attention_heads=heads,
                               num_query_groups=groups, use_cpu_initialization=True, masked_softmax_fusion=False,
                               attention_dropout=0.0)
    generator = torch.Generator().manual_seed(0)
    seq, batch, dim = 11, 3, 16
    q = torch.randn(seq, batch, heads, dim, generator=generator, requires_grad=True)
    k = torch.randn(seq, batch, groups, dim, generator=generator, requires_grad=True)
    v = torch.randn(seq, batch, groups, dim, generator=generator, requires_grad=True)
    mask = None
    if explicit_mask:  # Megatron's convention: True hides; causal plus the first key hidden for odd rows
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).expand(batch, 1, seq, seq).clone()
        mask[1, :, 1:, 0] = True
    outputs, grads = [], []
    for cls in (DotProductAttention, SDPAttention):
        module = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        out = module(q, k, v, mask)
        (grad_q, grad_k, grad_v) = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(),
                                                       (q, k, v))
        outputs.append(out)
        grads.append((grad_q, grad_k, grad_v))
    return {"case": case, "shape": list(outputs[1].shape), "same_shape": outputs[0].shape == outputs[1].shape,
            "out_gap": float((outputs[0] - outputs[1]).abs().max()),
            "grad_gap": max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))}


def main() -> None:
    init_megatron(seed=0)
    for case, heads, groups, explicit in [("causal MHA", 4, 4, False), ("causal GQA 4:2", 4, 2, False),
                                          ("explicit mask GQA", 4, 1, True)]:
        print(json.dumps(compare(case, heads, groups, explicit)), flush=True)
    models = make_bridge(sys.argv[1]).get_model(wrap_with_ddp=False, bf16=False, use_cpu_initialization=True)
    names = sorted({type(m).__name__ for m in models[0].modules() if "Attention" in type(m).__name__})
    print(json.dumps({"case": "bridged model", "attention_modules": names}), flush=True)


if __name__ == "__main__":
    main()
