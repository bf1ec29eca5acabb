"""Run in a subprocess by test_convert_export.py (Megatron's CPU patches are process-global).

For each HF model directory given: convert to Megatron, compare logits with the HF model on the same
tokens, export back to HF, compare every tensor. Prints one JSON line per model.

    python roundtrip.py [--bf16] HF_DIR WORK_DIR [HF_DIR WORK_DIR ...]
"""

import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slime.config import load_config
from slime.stages.convert import run_convert
from slime.stages.export import run_export


def logits_gap(hf_dir: str, checkpoint: str, dtype: torch.dtype) -> float:
    from slime.backends.megatron.bridge import build_model, make_bridge
    from slime.backends.megatron.checkpoint import load_model_checkpoint

    bridge = make_bridge(hf_dir, dtype)
    models = build_model(bridge)
    load_model_checkpoint(models, checkpoint)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=bridge.dtype).to(device).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        expected = hf(ids).logits
        models[0].eval()
        got = models[0](input_ids=ids, position_ids=torch.arange(24, device=device).expand(2, 24), attention_mask=None)
    return (got[..., : expected.shape[-1]].float() - expected.float()).abs().max().item()


def main() -> None:
    argv = sys.argv[1:]
    bf16 = argv[:1] == ["--bf16"]
    argv = argv[1:] if bf16 else argv
    for hf_dir, work in zip(argv[0::2], argv[1::2], strict=True):
        config = load_config(None, ["--hf-checkpoint", hf_dir, "--save", f"{work}/ckpt", "--load", f"{work}/ckpt",
                                    "--output-dir", f"{work}/hf", *(["--bf16"] if bf16 else [])])
        converted = run_convert(config)
        gap = logits_gap(hf_dir, converted["checkpoint"], torch.bfloat16 if bf16 else torch.float32)
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
