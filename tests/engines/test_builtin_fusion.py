"""Fused q/k/v and gate/up projections of the slot decoder (fusion.py), on CPU in fp32: the decode step's
logits with and without them, the views' storage, every in-place weight path writing the fused buffers, and
the memory release's parking moving the buffers without breaking the views."""

import asyncio

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from slot_models import small, tiny

from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.engines.builtin.fusion import ATTENTION, MLP, ProjectionFusion, weight_slots
from slime.engines.builtin.slots import SlotDecoder
from slime.offload import module_slots
from slime.sync.common import in_thread
from slime.sync.distributed import GROUP_NAME, _TrainerGroup, trainer_store
from slime.sync.tensor import _FileSystemSharing, pack_bucket, serialize_named_tensors

PROMPT = [52, 43, 53, 61, 7, 19, 33, 8]
NEW = 8


def decode_logits(model, projections, steps=3, batch=5):
    """Logits of a few decode steps over the same random cache, with or without fused projections."""
    decoder = SlotDecoder(model, slots=8, max_len=64, device=torch.device("cpu"), cuda_graphs=False,
                          projections=projections)
    generator = torch.Generator().manual_seed(3)
    for cache in decoder.keys + decoder.values:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    tokens = torch.randint(0, model.config.vocab_size, (steps, batch), generator=generator)
    with torch.inference_mode():
        return [decoder.decode(tokens[s], [10 + 7 * r + s for r in range(batch)]) for s in range(steps)]


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_decode_logits_equal_with_and_without_fusion(tiny_kit, kind):
    model = tiny(tiny_kit) if kind == "qwen2" else small(kind)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    unfused = decode_logits(model, None)
    fusion = ProjectionFusion(model)
    assert all(fusion.attention) and all(fusion.mlp)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # values kept, storage shared
    fused = decode_logits(model, fusion)
    for a, b in zip(unfused, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert not torch.equal(unfused[0], unfused[1])  # the steps differ: the comparison is not vacuous


def test_members_are_views_into_one_buffer_and_writes_reach_it(tiny_kit):
    model = tiny(tiny_kit)
    fusion = ProjectionFusion(model)
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv, gate_up = fusion.attention[1], fusion.mlp[1]
    assert qkv.bias is not None and gate_up.bias is None  # Qwen2: q/k/v biases, no MLP biases
    assert qkv.weight.shape[0] == sum(getattr(attention, n).out_features for n in ATTENTION)
    assert gate_up.weight.shape[0] == 2 * model.config.intermediate_size
    assert attention.k_proj.weight.data_ptr() == qkv.weight[attention.q_proj.out_features].data_ptr()
    with torch.no_grad():
        attention.v_proj.bias.fill_(0.25)
        mlp.up_proj.weight.fill_(-1.0)
    assert (qkv.bias[-attention.v_proj.out_features:] == 0.25).all()
    assert (gate_up.weight[model.config.intermediate_size:] == -1.0).all()
    assert qkv.tied() and gate_up.tied()
    assert len(fusion.names) == model.config.num_hidden_layers * (2 * len(ATTENTION) + len(MLP))


def test_only_uniform_groups_are_fused(tiny_kit, caplog):
    model = tiny(tiny_kit)
    model.model.layers[2].self_attn.k_proj.bias = None  # q and v keep theirs: no common bias buffer
    with caplog.at_level("INFO", logger="slime.engines.builtin.fusion"):
        fusion = ProjectionFusion(model)
    assert fusion.attention[2] is None and all(g is not None for i, g in enumerate(fusion.attention) if i != 2)
    assert all(fusion.mlp)
    assert "q/k/v left unfused (layer 2: some have a bias, some not)" in caplog.text
    unfused = decode_logits(model, None)
    for a, b in zip(unfused, decode_logits(model, fusion), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_parking_moves_the_buffers_and_keeps_the_views(tiny_kit, caplog):
    """`HostParking` moves tensors by assigning `.data` (pinned host memory needs CUDA, so each slot's move is
    done here as a park + unpark does it: `put` of a fresh copy)."""
    model = tiny(tiny_kit)
    fusion = ProjectionFusion(model)
    reference = decode_logits(model, fusion)
    slots = weight_slots(model, fusion)
    assert sum(get().numel() for _, get, _ in slots) == sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    assert not fusion.names & {key for key, _, _ in slots}  # the members move with their buffers only
    for _, get, put in slots:
        put(get().clone())
    assert all(group.tied() for _, group in fusion.groups())
    for a, b in zip(reference, decode_logits(model, fusion), strict=True):
        assert torch.equal(a, b)

    # a mover that replaces the members' `.data` one by one breaks the views: the decoder re-ties them
    for _, get, put in module_slots(model):
        put(get().clone())
    assert not any(group.tied() for _, group in fusion.groups())
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)  # lands in the member only, not the old buffer
    unfused = decode_logits(model, None)
    with caplog.at_level("WARNING", logger="slime.engines.builtin.fusion"):
        refused = decode_logits(model, fusion)
    assert f"{2 * model.config.num_hidden_layers} fused projection groups had lost their views" in caplog.text
    assert all(group.tied() for _, group in fusion.groups())
    for a, b in zip(unfused, refused, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- the engine's update paths


def generate(engine):
    out = asyncio.run(engine.generate({"input_ids": PROMPT, "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                           "ignore_eos": True}}))
    return out["output_ids"], torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def teacher_forced(model, output_ids):
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output_ids])).logits[0].float()
    steps = torch.log_softmax(logits[len(PROMPT) - 1:-1], dim=-1)
    return steps.gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1)


def fresh_model(tiny_kit, state):
    """An unfused model holding `state` (what a fresh engine would load)."""
    model = tiny(tiny_kit)
    model.load_state_dict(state)
    return model


def check(engine, reference):
    """The fused engine's decode uses the weights `reference` (an unfused model) holds."""
    ids, logprobs = generate(engine)
    torch.testing.assert_close(logprobs, teacher_forced(reference, ids), rtol=0, atol=1e-5)
    assert all(group.tied() for _, group in engine.scheduler.projections.groups())
    return ids, logprobs


def state_of(engine):
    return {n: t.detach().clone() for n, t in engine.model.state_dict().items()}


@pytest.fixture
def engine(tiny_kit):
    eng = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), kv_cache="slots", random_seed=1,
                                   enable_lora=True))
    assert eng.scheduler.projections is not None
    yield eng
    eng.shutdown()


def test_disk_update_reaches_the_fused_buffers_and_equals_a_fresh_engine(engine, tiny_kit, tmp_path):
    generator = torch.Generator().manual_seed(5)
    state = {n: (t + 0.05 * torch.randn(t.shape, generator=generator)).contiguous()
             for n, t in state_of(engine).items() if n != "lm_head.weight"}  # tied to the embedding
    save_file(state, str(tmp_path / "model.safetensors"))
    before, _ = generate(engine)
    assert engine.update_weights_from_disk(str(tmp_path), "v2")["success"]
    ids, logprobs = check(engine, fresh_model(tiny_kit, {**state, "lm_head.weight": state["model.embed_tokens.weight"]}))
    assert ids != before  # the new weights changed what is generated
    (tmp_path / "config.json").write_bytes((tiny_kit.model_dir / "config.json").read_bytes())
    fresh = BuiltinEngine(EngineArgs(model_path=str(tmp_path), tokenizer_path=str(tiny_kit.model_dir),
                                     kv_cache="slots", random_seed=1))
    try:
        fresh_ids, fresh_logprobs = generate(fresh)
    finally:
        fresh.shutdown()
    assert fresh_ids == ids
    torch.testing.assert_close(fresh_logprobs, logprobs, rtol=0, atol=1e-6)


def test_tensor_and_distributed_updates_reach_the_fused_buffers(engine, tiny_kit):
    generator = torch.Generator().manual_seed(6)
    layer = "model.layers.1"
    named = [(f"{layer}.self_attn.{n}.{kind}", None) for n in ATTENTION for kind in ("weight", "bias")]
    named += [(f"{layer}.mlp.{n}.weight", None) for n in MLP]
    state = state_of(engine)
    named = [(n, torch.randn(state[n].shape, generator=generator) * 0.2) for n, _ in named]
    with _FileSystemSharing():
        views, _flats = pack_bucket(named)
        payload = serialize_named_tensors(views)
        assert engine.update_weights_from_tensor({"serialized_named_tensors": [payload]})["success"]
    state.update(named)
    check(engine, fresh_model(tiny_kit, state))

    name = "model.layers.2.self_attn.k_proj.weight"
    new = torch.randn(state[name].shape, generator=generator) * 0.2
    store = trainer_store("127.0.0.1", 2, dist.default_pg_timeout)
    body = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP_NAME, "backend": "gloo"}

    async def run():
        trainer = in_thread(lambda: _TrainerGroup(store, 2, "gloo", dist.default_pg_timeout))
        joined = await asyncio.to_thread(engine.init_weights_update_group, body)
        assert joined["success"], joined
        group = await trainer
        sending = in_thread(lambda: group.broadcast([new]))
        result = await asyncio.to_thread(engine.update_weights_from_distributed, {
            "names": [name], "dtypes": ["float32"], "shapes": [list(new.shape)], "group_name": GROUP_NAME})
        await sending
        return result

    assert asyncio.run(run())["success"]
    state[name] = new
    check(engine, fresh_model(tiny_kit, state))


def test_lora_merge_and_unload_reach_the_fused_buffers(engine, tiny_kit, tmp_path):
    torch.manual_seed(7)
    base = tiny(tiny_kit)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[*ATTENTION, *MLP], init_lora_weights=False,
                        base_model_name_or_path=str(tiny_kit.model_dir))
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    merged = peft_model.merge_and_unload()
    base_ids, _ = generate(engine)
    assert engine.load_lora_adapter({"lora_name": "a", "lora_path": str(tmp_path / "adapter")})["success"]
    ids, _ = check(engine, merged)
    assert ids != base_ids
    assert engine.unload_lora_adapter({"lora_name": "a"})["success"]
    assert check(engine, tiny(tiny_kit))[0] == base_ids


def test_disabled_fusion_keeps_the_modules(tiny_kit):
    eng = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), kv_cache="slots",
                                   disable_fused_projections=True))
    try:
        assert eng.scheduler.projections is None
        ids, logprobs = generate(eng)
        torch.testing.assert_close(logprobs, teacher_forced(tiny(tiny_kit), ids), rtol=0, atol=1e-5)
    finally:
        eng.shutdown()
    dynamic = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), kv_cache="dynamic"))
    try:
        assert dynamic.scheduler.projections is None  # only the slot decoder reads the fused buffers
    finally:
        dynamic.shutdown()
