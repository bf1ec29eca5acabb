"""Tensor parallelism 2 (vocab-sharded logits, gloo on CPU) gives the log-probs, entropies and train
step of tensor parallelism 1 (fp32). Tolerances: log-probs 1e-5, entropies 1e-5, weights after one SGD
step 1e-6 (measured 4.8e-7, 1.9e-6 and 2.2e-8: the sharded softmax sums in a different order)."""

from pathlib import Path

import pytest
from multirank import run_ranks
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

SCRIPT = Path(__file__).with_name("tp_parity.py")


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def test_tensor_parallel_2_equals_1(tiny_kit, tmp_path):
    one = run_ranks(SCRIPT, world_size=1, args=[str(tiny_kit.model_dir), str(tmp_path)], timeout=900)[0][0]
    two = run_ranks(SCRIPT, world_size=2, args=[str(tiny_kit.model_dir), str(tmp_path)], timeout=900)
    assert two[0][0]["log_probs"] == two[1][0]["log_probs"]  # every TP rank holds the full result
    assert max(abs(a - b) for a, b in zip(flat(one["log_probs"]), flat(two[0][0]["log_probs"]), strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(flat(one["entropies"]), flat(two[0][0]["entropies"]), strict=True)) < 1e-5
    for name in ("loss", "entropy_loss", "kl_loss", "tis", "grad_norm"):
        assert two[0][0]["metrics"][name] == pytest.approx(one["metrics"][name], abs=1e-5), name
    a, b = load_file(tmp_path / "tp1.safetensors"), load_file(tmp_path / "tp2.safetensors")
    assert a.keys() == b.keys()  # export gathers the shards back to full HF tensors
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    initial = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir).state_dict()
    assert max((a[k] - initial[k]).abs().max().item() for k in a) > 1e-3  # the step moved the weights
