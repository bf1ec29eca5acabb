"""Rollout routing replay's rollout side (routing.py): asking for routed experts only when routing replay is on,
decoding SGLang's encoding into `Sample.rollout_routed_experts` (one list of layers x topk ids per token but the
last), a start offset, truncation, and the whole way from the built-in engine on a tiny Qwen3-MoE."""

import asyncio
import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from slime.data.tiny import build_tokenizer
from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.engines.builtin.moe import encode_routed_experts
from slime.engines.client import EngineClient
from slime.errors import DataFormatError, EngineError
from slime.rollout.generate import generate, truncate_response
from slime.rollout.http import generate_url
from slime.rollout.multiturn import append_model_output
from slime.rollout.routing import apply_routed_experts, decode_routed_experts, wants_routed_experts
from slime.types import Sample

LAYERS, TOP_K = 3, 2


def encoded(rows: int, first: int = 0) -> str:
    """SGLang's encoding of [rows, LAYERS, TOP_K] ids counting up from `first`."""
    ids = torch.arange(first, first + rows * LAYERS * TOP_K, dtype=torch.int32).view(rows, LAYERS, TOP_K)
    return encode_routed_experts([ids], 0, rows)


def test_decoding_gives_one_list_of_layers_times_topk_ids_per_token():
    rows = decode_routed_experts(encoded(4), 4)
    assert rows == [list(range(i * 6, i * 6 + 6)) for i in range(4)]
    assert all(isinstance(x, int) for x in rows[0])
    as_slime = np.frombuffer(base64.b64decode(encoded(4)), np.int32).reshape(4, LAYERS, TOP_K)  # slime's decoding
    assert rows == as_slime.reshape(4, -1).tolist()
    assert decode_routed_experts(encoded(0), 0) == []
    with pytest.raises(DataFormatError, match="holds 24 int32 ids, not a whole number of ids for each of 5 tokens"):
        decode_routed_experts(encoded(4), 5)
    with pytest.raises(DataFormatError, match="not base64"):
        decode_routed_experts("not base64!", 4)


def test_each_answer_replaces_the_record_and_a_start_keeps_what_came_before():
    sample = Sample(tokens=list(range(6)), response_length=2)
    apply_routed_experts(sample, {})
    assert sample.rollout_routed_experts is None  # not asked: nothing
    apply_routed_experts(sample, {"routed_experts": encoded(5)})
    first = sample.rollout_routed_experts
    assert len(first) == 5
    sample.tokens += [7, 8, 9]
    apply_routed_experts(sample, {"routed_experts": encoded(5, first=1000), "routed_experts_start_len": 3})
    assert sample.rollout_routed_experts[:3] == first[:3] and sample.rollout_routed_experts[3][0] == 1000
    assert len(sample.rollout_routed_experts) == len(sample.tokens) - 1
    with pytest.raises(DataFormatError, match="start at token 9, but only 8 tokens' routing is recorded"):
        apply_routed_experts(sample, {"routed_experts": encoded(0), "routed_experts_start_len": 9})
    truncate_response(sample, 2)
    assert len(sample.rollout_routed_experts) == len(sample.tokens) - 1


class RoutingRouter:
    """Replaces `EngineClient.post` and `.get`: records each payload and where it went, answers 3 tokens with routed
    experts when asked; lists two healthy workers and a dead one at `/workers`."""

    WORKERS = ["http://w2:1", "http://w1:1/", "http://dead:1"]

    def __init__(self) -> None:
        self.payloads: list[dict] = []
        self.urls: list[str] = []

    async def get(self, url: str, timeout_s=None):
        assert url == "http://127.0.0.1:1/workers"
        return {"workers": [{"url": u, "is_healthy": "dead" not in u} for u in self.WORKERS]}

    async def post(self, url: str, json=None):
        self.payloads.append(json)
        self.urls.append(url)
        meta = {"output_token_logprobs": [[-0.5, 7, None]] * 3, "finish_reason": {"type": "length"},
                "weight_version": "1"}
        if json.get("return_routed_experts"):
            meta["routed_experts"] = encoded(len(json["input_ids"]) + 3 - 1)
        return {"text": "xxx", "meta_info": meta}


@pytest.mark.parametrize("replay", [False, True], ids=["off", "on"])
def test_generate_asks_only_with_routing_replay(monkeypatch, replay):
    router = RoutingRouter()
    monkeypatch.setattr(EngineClient, "post", router.post)
    monkeypatch.setattr(EngineClient, "get", router.get)
    args = SimpleNamespace(sglang_router_ip="127.0.0.1", sglang_router_port=1, use_rollout_routing_replay=replay)
    assert wants_routed_experts(args) is replay
    sample = asyncio.run(generate(args, Sample(prompt="p", tokens=[1, 2, 3, 4]), {"max_new_tokens": 3}))
    assert router.payloads[0].get("return_routed_experts", False) is replay
    # sglang-router 0.3.2 drops return_routed_experts from the bodies it forwards: asked, generate goes to a worker
    assert router.urls[0] == ("http://w1:1/generate" if replay else "http://127.0.0.1:1/generate")
    if replay:
        assert len(sample.rollout_routed_experts) == len(sample.tokens) - 1 == 6
        assert all(len(row) == LAYERS * TOP_K for row in sample.rollout_routed_experts)
    else:
        assert sample.rollout_routed_experts is None
    sample.validate()


def test_asking_for_routed_experts_sends_past_the_router_to_each_healthy_worker_in_turn(monkeypatch):
    router = RoutingRouter()
    monkeypatch.setattr(EngineClient, "get", router.get)
    args = SimpleNamespace(sglang_router_ip="127.0.0.1", sglang_router_port=1)

    async def urls(n: int, routed: bool) -> list[str]:
        return [await generate_url(args, return_routed_experts=routed) for _ in range(n)]

    assert asyncio.run(urls(4, True)) == ["http://w1:1/generate", "http://w2:1/generate"] * 2
    assert asyncio.run(urls(2, False)) == ["http://127.0.0.1:1/generate"] * 2
    router.WORKERS = ["http://dead:1"]
    with pytest.raises(EngineError, match="no healthy worker at the router http://127.0.0.1:1"):
        asyncio.run(urls(1, True))


def test_built_in_engine_answers_fold_into_the_sample(tmp_path):
    """A tiny Qwen3-MoE in the built-in engine: the sample's records are the experts `transformers` routes to."""
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=TOP_K, max_position_embeddings=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = BuiltinEngine(EngineArgs(model_path=str(tmp_path), kv_cache="slots"))
    try:
        sample = Sample(prompt="1+1=", tokens=tokenizer.encode("1+1="))
        output = asyncio.run(engine.generate({"input_ids": sample.tokens, "return_logprob": True,
                                              "return_routed_experts": True,
                                              "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}))
    finally:
        engine.shutdown()
    append_model_output(None, sample, output)
    sample.validate()
    with torch.no_grad():
        logits = engine.model(torch.tensor([sample.tokens]), output_router_logits=True).router_logits
    want = torch.stack([torch.topk(torch.softmax(x, -1, dtype=torch.float), TOP_K).indices for x in logits], dim=1)
    assert sample.rollout_routed_experts == want[:-1].reshape(len(sample.tokens) - 1, -1).tolist()
