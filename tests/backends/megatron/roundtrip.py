"""Run in a subprocess by test_convert_export.py (Megatron's CPU patches are process-global).

For each HF model directory given: convert to Megatron, compare logits with the HF model on the same
tokens, export back to HF, compare every tensor. Prints one JSON line per model.
"""

import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slime.config import load_config
from slime.convert import run_convert
from slime.export import run_export


def logits_gap(hf_dir: str, checkpoint: str) -> float:
    from slime.backends.megatron.bridge import build_model, make_bridge
    from slime.backends.megatron.checkpoint import load_model_checkpoint

    bridge = make_bridge(hf_dir)
    models = build_model(bridge)
    load_model_checkpoint(models, checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        models[0].eval()
        got = models[0](input_ids=ids, position_ids=torch.arange(24).expand(2, 24), attention_mask=None)
    return (got[..., : expected.shape[-1]] - expected).abs().max().item()


def main() -> None:
    for hf_dir, work in zip(sys.argv[1::2], sys.argv[2::2], strict=True):
        config = load_config(None, ["--hf-checkpoint", hf_dir, "--save", f"{work}/ckpt", "--load", f"{work}/ckpt",
                                    "--output-dir", f"{work}/hf"])
        converted = run_convert(config)
        gap = logits_gap(hf_dir, converted["checkpoint"])
        exported = run_export(config)
        original, back = load_file(f"{hf_dir}/model.safetensors"), load_file(f"{exported['hf_dir']}/model.safetensors")
        print(json.dumps({
            "hf_dir": hf_dir,
            "logits_gap": gap,
            "names_equal": sorted(original) == sorted(back),
            "bit_exact": all(torch.equal(original[k], back[k]) and original[k].dtype == back[k].dtype
                             for k in original if k in back),
            "export": exported["hf_dir"],
        }), flush=True)


if __name__ == "__main__":
    main()
