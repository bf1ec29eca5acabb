"""The built-in engine's LoRA endpoints (lora.py), as SGLang's: /load_lora_adapter, /unload_lora_adapter and
`lora_path` in /generate, on a real server process with adapters written by peft itself."""

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from slime.engines.builtin.launcher import start_builtin_engine
from slime.engines.builtin.lora import LoraAdapters

TOKENS = [52, 43, 53, 61, 7, 19, 33, 8, 41, 12]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, out, *, seed, rank=4, targets=TARGETS):
    """A PEFT LoRA directory on the tiny model with non-zero B (peft's init_lora_weights=False)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                        base_model_name_or_path=str(model_dir))
    get_peft_model(base, config).save_pretrained(str(out))
    return str(out)


def reference_log_probs(model_dir, adapter=None):
    """Teacher-forced log-probs of TOKENS[1:] from transformers (+ peft's unmerged adapter)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:]).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.fixture(scope="module")
def server(tiny_kit, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    process, url = start_builtin_engine(str(tiny_kit.model_dir), log_path=log, dtype="float32",
                                        extra_args=["--enable-lora", "--max-lora-rank", "8",
                                                    "--lora-target-modules", *TARGETS])
    try:
        yield url
    finally:
        process.stop()
    assert not process.alive


@pytest.fixture(scope="module")
def adapters(tiny_kit, tmp_path_factory):
    work = tmp_path_factory.mktemp("adapters")
    return {"v1": make_adapter(tiny_kit.model_dir, work / "v1", seed=1),
            "v2": make_adapter(tiny_kit.model_dir, work / "v2", seed=2),
            "rank16": make_adapter(tiny_kit.model_dir, work / "r16", seed=3, rank=16),
            "mlp": make_adapter(tiny_kit.model_dir, work / "mlp", seed=4, targets=["down_proj"])}


@pytest.fixture
def http():
    with httpx.Client(timeout=120, trust_env=False) as client:
        yield client


def scored(http, url, **extra):
    reply = http.post(f"{url}/generate", json={"input_ids": TOKENS, "return_logprob": True, "logprob_start_len": 0,
                                               "sampling_params": {"max_new_tokens": 0}, **extra})
    assert reply.status_code == 200, reply.text
    return [lp for lp, _, _ in reply.json()["meta_info"]["input_token_logprobs"][1:]]


def max_gap(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_load_generate_replace_unload(server, http, adapters, tiny_kit):
    base = scored(http, server)
    assert max_gap(base, reference_log_probs(tiny_kit.model_dir)) < 1e-5

    answer = http.post(f"{server}/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["v1"]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["success"] and list(answer.json()["loaded_adapters"]) == ["a"]
    with_a = scored(http, server, lora_path="a")
    gap = max_gap(with_a, reference_log_probs(tiny_kit.model_dir, adapters["v1"]))
    print(f"engine (merged) vs peft (unmerged) log-prob gap: {gap:.2e}")
    assert gap < 1e-5 and max_gap(with_a, base) > 1e-3
    assert scored(http, server) == with_a, "no lora_path while one adapter is loaded: generate with it"

    missing = http.post(f"{server}/generate", json={"input_ids": TOKENS, "lora_path": "b",
                                                      "sampling_params": {"max_new_tokens": 1}})
    assert missing.status_code == 400
    assert "requested LoRA adapters are not loaded: b" in missing.json()["error"]["message"]

    again = http.post(f"{server}/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["v2"]})
    assert again.status_code == 400 and "already exists" in again.json()["error_message"]

    answer = http.post(f"{server}/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["v2"]})
    assert answer.status_code == 200 and list(answer.json()["loaded_adapters"]) == ["b"], answer.text
    with_b = scored(http, server, lora_path="b")
    assert max_gap(with_b, reference_log_probs(tiny_kit.model_dir, adapters["v2"])) < 1e-5, "base + v2, not stacked"
    gone = http.post(f"{server}/generate", json={"input_ids": TOKENS, "lora_path": "a",
                                                   "sampling_params": {"max_new_tokens": 1}})
    assert gone.status_code == 400, "loading b replaced a"

    update = http.post(f"{server}/update_weights_from_disk", json={"model_path": str(tiny_kit.model_dir)})
    assert update.status_code == 400 and "unload it" in update.json()["message"]

    answer = http.post(f"{server}/unload_lora_adapter", json={"lora_name": "b"})
    assert answer.status_code == 200 and answer.json()["loaded_adapters"] == {}
    assert scored(http, server) == base, "unload must restore the base weights exactly"
    info = http.get(f"{server}/server_info").json()["internal_states"][0]
    assert info["lora_adapters"] == []


@pytest.mark.parametrize("case, message", [
    ("rank16", "exceeds --max-lora-rank 8"),
    ("missing", "no adapter_config.json"),
    ("unknown", "does not exist"),
])
def test_refusals_are_400_and_change_nothing(server, http, adapters, case, message, tmp_path):
    before = scored(http, server)
    if case == "unknown":
        answer = http.post(f"{server}/unload_lora_adapter", json={"lora_name": "nope"})
    else:
        path = adapters.get(case, str(tmp_path))
        answer = http.post(f"{server}/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
    assert answer.status_code == 400 and message in answer.json()["error_message"], answer.text
    assert scored(http, server) == before


def test_adapter_checks_in_process(tiny_kit, adapters, tmp_path):
    """Refusals that need another engine configuration: LoRA off, targets, another base directory."""
    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()

    def slot(**kw):
        options = {"enabled": True, "max_rank": None, "target_modules": None, "model_path": str(tiny_kit.model_dir),
                   **kw}
        return LoraAdapters(model, lambda fn: fn(), **options)

    off = slot(enabled=False).load("a", adapters["v1"])
    assert not off["success"] and "--enable-lora" in off["error_message"]
    narrow = slot(target_modules=["q_proj", "k_proj", "v_proj"]).load("a", adapters["mlp"])
    assert not narrow["success"] and "not in --lora-target-modules" in narrow["error_message"]
    other = slot(model_path=str(tmp_path)).load("a", adapters["v1"])
    assert not other["success"] and "base_model_name_or_path" in other["error_message"]
    ok = slot(target_modules=["all"])
    assert ok.load("a", adapters["mlp"])["success"]
    assert ok.unload("a")["success"]


def test_host_twins_follow_a_full_weight_update(tiny_kit, adapters):
    """The base copies kept across loads: an unload restores the base bit-exactly, the next load reuses them, and
    a full weight update in between (allowed only while no adapter is merged) makes them stale, so the later
    unload restores the new base, not the old one."""
    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()
    slot = LoraAdapters(model, lambda fn: fn(), enabled=True, max_rank=None, target_modules=None,
                        model_path=str(tiny_kit.model_dir))
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert slot.load("a", adapters["v1"])["success"]
    q = "model.layers.0.self_attn.q_proj.weight"
    merged = model.get_parameter(q).detach().clone()
    assert not torch.equal(merged, base[q])
    assert slot.unload("a")["success"]
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters())
    assert slot.load("b", adapters["v1"])["success"]  # the twins are reused: the same merge again
    assert torch.equal(model.get_parameter(q), merged)
    assert slot.unload("b")["success"]

    slot.check_full_update()  # what the engine calls before it writes new weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    updated = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert slot.load("c", adapters["v1"])["success"]
    assert slot.unload("c")["success"]
    assert all(torch.equal(p, updated[n]) for n, p in model.named_parameters())
