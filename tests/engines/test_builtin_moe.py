"""The built-in engine on Qwen3-MoE and GLM-4.5 (moe.py, the slot decoder's MoE layers, routed experts, weight
updates), on CPU in fp32 against `transformers`' `Qwen3MoeForCausalLM` / `Glm4MoeForCausalLM` on tiny random models:
the router and every expert dispatch equal the `transformers` block; prefill and decode logits equal its forward; the
engine's greedy tokens and log-probs equal its own; `return_routed_experts` gives SGLang's format with the ids its
routers choose (-1 in GLM-4.5's dense first layer); in-place weight updates by per-expert names change the outputs.
Tolerance: 1e-5, as the dense engine-vs-HF tests (measured: the GLM-4.5 slot decoder's logits within 2e-7 of the
`transformers` forward). GLM-4.5's own weight updates, MTP layers and refusals: test_builtin_glm4_moe.py."""

import asyncio
import base64

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from slime.data.random_models import glm4_moe_config
from slime.data.tiny import build_tokenizer
from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.engines.builtin.fusion import ProjectionFusion
from slime.engines.builtin.moe import (
    MODES,
    encode_routed_experts,
    experts_forward,
    moe_layers,
    route,
    shared_expert_forward,
)
from slime.engines.builtin.sampling import BadRequestError
from slime.engines.builtin.slots import SlotDecoder, slot_support
from slime.sync.tensor import _FileSystemSharing, pack_bucket, serialize_named_tensors

CPU = torch.device("cpu")
ATOL = 1e-5  # as tests/engines/test_builtin_engine.py and test_slot_prefill.py (fp32)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [9], [12, 13, 14, 15, 16, 17]]


def tiny_moe(seed: int = 0, **overrides) -> AutoModelForCausalLM:
    """A random Qwen3-MoE over the tiny kit's vocabulary: hidden 64, 2 layers, 8 experts, top-2."""
    shape = dict(vocab_size=len(build_tokenizer()), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, eos_token_id=None)
    shape.update(overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**shape), dtype=torch.float32).eval()


def tiny_glm(seed: int = 0, **overrides) -> AutoModelForCausalLM:
    """A random GLM-4.5-style model, random_models' "tiny" (hidden 64, 3 layers, layer 0 dense, 8 routed experts in 2
    groups of which 1 is kept, top-2, a shared expert, routed_scaling_factor 2.5, half-rotary heads, q/k norms, q/k/v
    biases), over the tiny kit's vocabulary; its expert bias ~ N(0, 0.1^2) (as save_random_glm4_moe) and q/k/v
    biases ~ N(0, 0.5^2) drawn (from_config leaves both at zero, so neither would be tested)."""
    torch.manual_seed(seed)
    config = glm4_moe_config("tiny", max_position_embeddings=256, eos_token_id=None,
                             **{"vocab_size": len(build_tokenizer()), **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0, 0.1)
            elif name.endswith("_proj.bias"):
                tensor.normal_(0, 0.5)
    return model


MODELS = {"qwen3_moe": tiny_moe, "glm4_moe": tiny_glm}


def hf_routing(model, tokens: list[int]) -> np.ndarray:
    """The experts `transformers`' own routers chose at every position of `tokens` in its forward: [T, layers, k]
    int32, -1 in a layer without a router (forward hooks on the routers: Qwen3-MoE's and GLM-4.5's both return
    (logits, weights, ids))."""
    seen = {}
    handles = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(i, out[2]))
               for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens], device=model.device))
    finally:
        for handle in handles:
            handle.remove()
    k = model.config.num_experts_per_tok
    return np.stack([seen[i].view(len(tokens), k).cpu().numpy() if i in seen else np.full((len(tokens), k), -1)
                     for i in range(len(model.model.layers))], axis=1).astype(np.int32)


def decode_routing(meta: dict, rows: int, layers: int, k: int) -> np.ndarray:
    """As slime's rollout decodes SGLang's field."""
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(rows, layers, k)


# ------------------------------------------------------------------ the block


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
@pytest.mark.parametrize("mode", MODES)
def test_router_and_expert_dispatch_equal_the_transformers_block(norm, mode):
    model = tiny_moe(norm_topk_prob=norm)
    block = model.model.layers[0].mlp
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, want_weights, want_ids = block.gate(x)
        weights, ids = route(block.gate, x)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=0, atol=0)
        got = experts_forward(block.experts, x, weights, ids, mode)
        torch.testing.assert_close(got, block(x.unsqueeze(0))[0], rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="MoE dispatch mode 'loop'"):
        experts_forward(block.experts, x, weights, ids, "loop")


@pytest.mark.parametrize("router", [{}, {"n_group": 1, "topk_group": 1}, {"n_group": 4, "topk_group": 2,
                                                                          "norm_topk_prob": False}],
                         ids=["2_groups_keep_1", "1_group", "4_groups_keep_2_raw"])
@pytest.mark.parametrize("mode", MODES)
def test_glm_router_and_expert_dispatch_equal_the_transformers_block(router, mode):
    """GLM-4.5's router (sigmoid, the expert bias in the choice only, group-limited top-k, routed_scaling_factor):
    ids and weights equal `Glm4MoeTopkRouter`'s exactly; routed experts + the shared expert equal `Glm4MoeMoE`. The
    drawn bias changes the choice (a router that ignored it would fail), and with groups limited every token's
    experts lie in its kept groups."""
    model = tiny_glm(**router)
    block = model.model.layers[1].mlp
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, want_weights, want_ids = block.gate(x)
        weights, ids = route(block.gate, x)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=0, atol=0)
        got = experts_forward(block.experts, x, weights, ids, mode) + shared_expert_forward(block.shared_experts, x)
        torch.testing.assert_close(got, block(x.unsqueeze(0))[0], rtol=0, atol=ATOL)
        bias = block.gate.e_score_correction_bias
        kept = bias.clone()
        bias.zero_()
        unbiased = route(block.gate, x)[1]
        bias.copy_(kept)
    assert (ids.sort(dim=-1).values != unbiased.sort(dim=-1).values).any(dim=-1).sum() >= 3
    groups, per_group = model.config.n_group, 8 // model.config.n_group
    chosen_groups = {tuple(sorted(set((row // per_group).tolist()))) for row in ids}
    assert all(len(g) <= model.config.topk_group for g in chosen_groups)
    if groups > model.config.topk_group:
        assert len(chosen_groups) > 1  # different tokens keep different groups


def test_routed_experts_wire_format_is_little_endian_int32_c_order():
    records = [torch.arange(12, dtype=torch.int32).view(3, 2, 2), torch.full((1, 2, 2), 7, dtype=torch.int32)]
    raw = base64.b64decode(encode_routed_experts(records, 1, 4))
    assert raw == np.arange(4, 12, dtype="<i4").tobytes() + np.full(4, 7, dtype="<i4").tobytes()
    with pytest.raises(RuntimeError, match="4 token records, asked for"):
        encode_routed_experts(records, 0, 5)


# ------------------------------------------------------------------ the slot decoder


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["all_moe", "mixed", "glm4_moe"])
def test_slot_decoder_equals_the_transformers_forward_and_its_routing(mode, layout):
    """Prefill then two decode steps (fused q/k/v): logits and routed experts of every fed token equal the
    `transformers` forward over the whole sequence; a dense layer (mlp_only_layers, GLM-4.5's first_k_dense_replace)
    records -1."""
    if layout == "glm4_moe":
        model = tiny_glm()
    else:
        model = tiny_moe(**({"num_hidden_layers": 3, "mlp_only_layers": [1]} if layout == "mixed" else {}))
    assert slot_support(model) is None
    projections = ProjectionFusion(model)
    # q/k/v fused everywhere; gate/up in a dense layer and GLM-4.5's shared experts (an MoE block's experts hold it
    # fused already)
    shared = [hasattr(layer.mlp, "shared_experts") for layer in model.model.layers]
    assert all(projections.attention)
    assert [group is None for group in projections.mlp] == [m and not s for m, s in zip(moe_layers(model), shared,
                                                                                          strict=True)]
    decoder = SlotDecoder(model, slots=6, max_len=32, device=CPU, cuda_graphs=False, projections=projections)
    decoder.moe_decode_mode = mode
    follow = [[21, 22], [23, 24], [25, 26], [27, 28]]
    with torch.inference_mode():
        prefill = decoder.prefill(PROMPTS, first_slot=1)
        routed = [decoder.last_routing[row, :len(p)] for row, p in enumerate(PROMPTS)]
        steps = []
        for s in range(2):
            steps.append(decoder.decode(torch.tensor([0] + [f[s] for f in follow]), [0] + [len(p) + s for p in PROMPTS]))
            routed = [torch.cat([r, decoder.last_routing[row + 1 : row + 2]]) for row, r in enumerate(routed)]
    layers = model.config.num_hidden_layers
    for row, (prompt, tokens) in enumerate(zip(PROMPTS, follow, strict=True)):
        sequence = prompt + tokens
        with torch.no_grad():
            full = model(torch.tensor([sequence])).logits[0]
        torch.testing.assert_close(prefill[row], full[len(prompt) - 1], rtol=0, atol=ATOL)
        for s in range(2):
            torch.testing.assert_close(steps[s][row + 1], full[len(prompt) + s], rtol=0, atol=ATOL)
        got = routed[row].numpy()
        assert got.shape == (len(sequence), layers, 2) and got.dtype == np.int32
        assert np.array_equal(got, hf_routing(model, sequence))
        assert [bool((got[:, layer] == -1).all()) for layer in range(layers)] == [not m for m in moe_layers(model)]


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-moe")
    tiny_moe().save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-glm4-moe")
    tiny_glm().save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def model_dir(request, moe_dir, glm_dir):
    return moe_dir if request.param == "qwen3_moe" else glm_dir


@pytest.fixture(scope="module", params=["slots", "dynamic", "slots_hf_prefill"])
def engine(model_dir, request):
    """The slot cache (slot prefill, or the transformers prefill + copy) and the dynamic cache, on each model."""
    args = EngineArgs(model_path=str(model_dir), random_seed=3, kv_cache=request.param.removesuffix("_hf_prefill"),
                      disable_slot_prefill=request.param.endswith("_hf_prefill"))
    eng = BuiltinEngine(args)
    yield eng
    eng.shutdown()


def shape(model) -> tuple[int, int]:
    """(layers, k) of a routed-experts record of `model`: every decoder layer, routed or not."""
    return model.config.num_hidden_layers, model.config.num_experts_per_tok


def generate(engine, body):
    return asyncio.run(engine.generate(body))


def teacher_forced(model, prompt, output):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return steps.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


def test_greedy_tokens_logprobs_and_routed_experts_equal_transformers(engine, model_dir):
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = [10, 6, 14, 3]  # unequal lengths: rows leave the running batch at different steps
    outs = generate(engine, {"input_ids": PROMPTS, "return_logprob": True, "return_routed_experts": True,
                             "sampling_params": [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
                                                 for n in new]})
    for prompt, n, out in zip(PROMPTS, new, outs, strict=True):
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        assert out["output_ids"] == want.tolist()
        meta = out["meta_info"]
        logprobs = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        torch.testing.assert_close(logprobs, teacher_forced(reference, prompt, out["output_ids"]), rtol=0, atol=ATOL)
        sequence = prompt + out["output_ids"]
        routed = decode_routing(meta, len(sequence) - 1, *shape(reference))
        assert meta["routed_experts_start_len"] == 0
        assert np.array_equal(routed, hf_routing(reference, sequence)[:-1])  # the last token was never fed


def test_sampled_requests_joining_a_running_batch_keep_their_routing(engine, model_dir):
    """A second group joins while the first decodes (slot compaction, the overlapped decode ahead); sampled."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def body(prompts, n):
        return {"input_ids": prompts, "return_routed_experts": True, "return_logprob": True,
                "sampling_params": [{"max_new_tokens": n + 3 * i, "temperature": 1.0, "ignore_eos": True}
                                    for i in range(len(prompts))]}

    async def go():
        first = asyncio.ensure_future(engine.generate(body(PROMPTS[:3], 12)))
        start = engine.scheduler.steps
        while engine.scheduler.steps < start + 3:
            await asyncio.sleep(0.002)
        late = await engine.generate(body(PROMPTS[3:] + [[40, 41]], 5))
        return list(zip(PROMPTS[:3], await first, strict=True)) + list(zip(PROMPTS[3:] + [[40, 41]], late, strict=True))

    for prompt, out in asyncio.run(go()):
        sequence = prompt + out["output_ids"]
        logprobs = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(logprobs, teacher_forced(reference, prompt, out["output_ids"]), rtol=0, atol=ATOL)
        routed = decode_routing(out["meta_info"], len(sequence) - 1, *shape(reference))
        assert np.array_equal(routed, hf_routing(reference, sequence)[:-1])


def test_routed_experts_from_a_start_and_for_prompt_scoring(engine, model_dir):
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[0]
    out = generate(engine, {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": 4,
                            "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}})
    sequence = prompt + out["output_ids"]
    assert out["meta_info"]["routed_experts_start_len"] == 4
    want = hf_routing(reference, sequence)[4:-1]
    assert np.array_equal(decode_routing(out["meta_info"], len(want), *shape(reference)), want)
    scored = generate(engine, {"input_ids": prompt, "return_routed_experts": True, "return_logprob": True,
                               "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
    assert np.array_equal(decode_routing(scored["meta_info"], len(prompt) - 1, *shape(reference)), hf_routing(reference, prompt)[:-1])
    plain = generate(engine, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert "routed_experts" not in plain["meta_info"]  # only when asked
    with pytest.raises(BadRequestError, match=r"routed_experts_start_len=10 must be an integer in \[0, 9\]"):
        generate(engine, {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": 10})


def test_dense_model_refuses_return_routed_experts(tiny_kit):
    engine = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir)))
    try:
        with pytest.raises(BadRequestError, match="return_routed_experts: qwen2 model .* has no MoE layers"):
            generate(engine, {"input_ids": [1, 2, 3], "return_routed_experts": True})
        out = generate(engine, {"input_ids": [1, 2, 3], "return_routed_experts": False,
                                "sampling_params": {"max_new_tokens": 1}})
        assert "routed_experts" not in out["meta_info"]
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ weight updates


def logits_of(engine, prompt):
    out = generate(engine, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                            "sampling_params": {"max_new_tokens": 0}})
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]


def per_expert_state(model) -> dict[str, torch.Tensor]:
    """`model`'s weights named as a checkpoint and slime's trainer name them (one tensor per expert)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                state[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half].clone()
                state[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:].clone()
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                state[f"{prefix}.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            state[name] = tensor.clone()
    return state


@pytest.fixture
def slot_engine(moe_dir):
    eng = BuiltinEngine(EngineArgs(model_path=str(moe_dir), kv_cache="slots"))
    yield eng
    eng.shutdown()


def test_tensor_update_by_per_expert_names_writes_the_fused_experts_in_place(slot_engine):
    model = slot_engine.model
    experts = model.model.layers[1].mlp.experts
    pointers = experts.gate_up_proj.data_ptr(), experts.down_proj.data_ptr()
    prompt = PROMPTS[0]
    before = logits_of(slot_engine, prompt)
    generate(slot_engine, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}})  # builds the slot cache
    update = [("model.layers.1.mlp.experts.3.up_proj.weight", torch.randn(32, 64)),
              ("model.layers.1.mlp.experts.3.down_proj.weight", torch.randn(64, 32)),
              ("model.layers.1.mlp.gate.weight", torch.randn(8, 64))]
    with _FileSystemSharing():
        views, _flats = pack_bucket(update)
        result = slot_engine.update_weights_from_tensor({"serialized_named_tensors": [serialize_named_tensors(views)]})
    assert result["success"], result["message"]
    assert (experts.gate_up_proj.data_ptr(), experts.down_proj.data_ptr()) == pointers
    assert torch.equal(experts.gate_up_proj[3, 32:], update[0][1])
    assert torch.equal(experts.down_proj[3], update[1][1])
    after = logits_of(slot_engine, prompt)
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3
    reference = tiny_moe()
    reference.load_state_dict(model.state_dict())
    out = generate(slot_engine, {"input_ids": prompt, "return_logprob": True,
                                 "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}})
    logprobs = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(logprobs, teacher_forced(reference, prompt, out["output_ids"]), rtol=0, atol=ATOL)
    bad = [("model.layers.1.mlp.experts.3.up_proj.weight", torch.randn(33, 64))]
    with _FileSystemSharing():
        views, _flats = pack_bucket(bad)
        refused = slot_engine.update_weights_from_tensor({"serialized_named_tensors": [serialize_named_tensors(views)]})
    assert not refused["success"] and "has shape [33, 64], the model's is [32, 64]" in refused["message"]


def test_disk_update_from_a_per_expert_checkpoint(slot_engine, tmp_path):
    other = tiny_moe(seed=5)
    save_file(per_expert_state(other), str(tmp_path / "model.safetensors"))
    prompt = PROMPTS[3]
    result = slot_engine.update_weights_from_disk(str(tmp_path), "v2")
    assert result["success"], result["message"]
    for name, tensor in other.state_dict().items():
        assert torch.equal(slot_engine.model.state_dict()[name], tensor), name
    torch.testing.assert_close(torch.tensor(logits_of(slot_engine, prompt)),
                               teacher_forced(other, prompt[:1], prompt[1:]), rtol=0, atol=ATOL)
    partial = per_expert_state(other)
    del partial["model.layers.0.mlp.experts.7.down_proj.weight"]
    (tmp_path / "partial").mkdir()
    save_file(partial, str(tmp_path / "partial" / "model.safetensors"))
    refused = slot_engine.update_weights_from_disk(str(tmp_path / "partial"), None)
    assert not refused["success"] and "missing ['model.layers.0.mlp.experts.down_proj']" in refused["message"]
