"""LoRA on the Megatron trainer (fp32, CPU): the adapted model at init is the base exactly; only adapters train
and hold optimizer state; the reference forward (adapters off) is the base; TP 2 (gloo) gives TP 1's losses
and merged export; the PEFT export loads with peft and gives Megatron's log-probs; merged HF weights too."""

from pathlib import Path

import pytest
import torch
from multirank import run_ranks
from parity_samples import make_samples
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

SCRIPT = Path(__file__).with_name("lora_parity.py")
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.fixture(scope="module")
def runs(tiny_kit, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    one = run_ranks(SCRIPT, world_size=1, args=[str(tiny_kit.model_dir), str(out)], timeout=900)[0][0]
    two = run_ranks(SCRIPT, world_size=2, args=[str(tiny_kit.model_dir), str(out)], timeout=900)
    return one, two, out


def test_at_init_the_adapted_model_is_the_base_exactly(runs):
    one, two, _ = runs
    assert one["init_logits_equal"] and all(rank[0]["init_logits_equal"] for rank in two)


def test_only_adapters_train_and_hold_optimizer_state(runs):
    one, _, _ = runs
    adapters = [n for n in one["all_params"] if n.rsplit(".", 1)[-1] in ("lora_a", "lora_b")]
    assert len(adapters) == 2 * len(TARGETS) * 4  # every targeted linear of the kit's 4 layers
    assert one["trainable"] == one["in_optimizer"] == one["with_state"] == sorted(adapters)
    assert one["with_grad"] == sorted(adapters)  # A's gradient is 0 at step 1 only (B = 0); after it, all move
    assert one["base_unchanged"] and one["b_moved"] > 1e-3
    assert one["counts"]["trainable"] < one["counts"]["total"] / 10


def test_micro_batch_2_runs_no_batched_gemm(runs):
    """The frozen output layer's input gradient at micro-batch 2 was a bmm of one GEMM per position (frozen_linear.py)."""
    one, two, _ = runs
    assert one["bmm"] == [] and all(rank[0]["bmm"] == [] for rank in two), (one["bmm"], [r[0]["bmm"] for r in two])


def test_reference_forward_is_the_frozen_base(runs):
    one, two, _ = runs
    assert one["reference_is_base"] and all(rank[0]["reference_is_base"] for rank in two)


def test_tensor_parallel_2_equals_1(runs):
    one, two, out = runs
    for step in (0, 1):  # step 2's loss is after an update through both A and B
        for name in ("loss", "pg_loss", "kl_loss", "entropy_loss", "grad_norm"):
            assert two[0][0]["steps"][step][name] == pytest.approx(one["steps"][step][name], abs=1e-5), (step, name)
    assert one["steps"][1]["loss"] != one["steps"][0]["loss"]
    gap = max(abs(a - b) for x, y in zip(one["log_probs"], two[0][0]["log_probs"], strict=True)
              for a, b in zip(x, y, strict=True))
    assert gap < 1e-5
    a, b = load_file(out / "merged-tp1.safetensors"), load_file(out / "merged-tp2.safetensors")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def _hf_log_probs(model, vocab: int) -> list[list[float]]:
    rows = []
    with torch.no_grad():
        for sample in make_samples(vocab):
            tokens = torch.tensor([sample.tokens])
            logp = torch.log_softmax(model(input_ids=tokens).logits[0].float(), dim=-1)
            prompt = len(sample.tokens) - sample.response_length
            targets = tokens[0, prompt:]
            rows.append(logp[prompt - 1:-1].gather(1, targets.unsqueeze(1)).squeeze(1).tolist())
    return rows


def _gap(x: list[list[float]], y: list[list[float]]) -> float:
    return max(abs(a - b) for r, s in zip(x, y, strict=True) for a, b in zip(r, s, strict=True))


@pytest.mark.parametrize("world", [1, 2])
def test_peft_export_loads_with_peft_and_matches_megatron(runs, tiny_kit, world):
    from peft import PeftModel

    one, _, out = runs
    base = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32)
    vocab = base.config.vocab_size
    untouched = _hf_log_probs(base, vocab)
    model = PeftModel.from_pretrained(base, str(out / f"peft-tp{world}")).eval()
    assert sorted(model.peft_config["default"].target_modules) == \
        ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert model.peft_config["default"].r == 4 and model.peft_config["default"].lora_alpha == 8
    peft_rows = _hf_log_probs(model, vocab)
    assert _gap(peft_rows, one["log_probs"]) < 1e-5
    assert _gap(untouched, one["log_probs"]) > 1e-3  # the adapters changed the model


def test_merged_export_is_megatrons_trained_model(runs, tiny_kit):
    one, _, out = runs
    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32)
    merged = load_file(out / "merged-tp1.safetensors")
    missing, unexpected = model.load_state_dict(merged, strict=False)
    assert not unexpected and all("lm_head" in k or "rotary" in k for k in missing)
    assert _gap(_hf_log_probs(model, model.config.vocab_size), one["log_probs"]) < 1e-5
