"""The slot prefill (`SlotDecoder.prefill`): prompts run through the slot decoder's own layers straight into
their slots, on CPU in fp32. Its last-position logits and the keys/values it writes equal the `transformers`
forward's and `write_prefill`'s copy of them (the path `--disable-slot-prefill` keeps), for Qwen2, Qwen3 and
Llama, fused projections or not, equal and unequal prompt lengths; the engine generates the same tokens and
log-probs either way."""

import asyncio

import pytest
import torch
from slot_models import build
from transformers import DynamicCache

from slime.engines.builtin.batch import left_padded, transformers_forward
from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.engines.builtin.fusion import ProjectionFusion
from slime.engines.builtin.slots import SlotDecoder, add_rms_norm, silu_mul

CPU = torch.device("cpu")
UNEQUAL = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [9], [12, 13, 14, 15, 16, 17]]
EQUAL = [[5, 6, 7, 8, 9], [40, 3, 4, 5, 6], [9, 8, 7, 6, 5]]


def hf_prefill(model, prompts, decoder, first_slot):
    """What the scheduler does with --disable-slot-prefill (its `left_padded` and `transformers_forward` into a
    DynamicCache), then `write_prefill`; the last position's logits."""
    ids, mask, positions = left_padded(prompts, CPU)
    cache = DynamicCache(config=model.config)
    logits = transformers_forward(model, ids, mask, positions, cache)
    decoder.write_prefill(cache, list(range(len(prompts))), [len(p) for p in prompts], first_slot)
    return logits


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "modules"])
@pytest.mark.parametrize("prompts", [UNEQUAL, EQUAL], ids=["unequal", "equal"])
def test_slot_prefill_equals_the_transformers_prefill_and_its_copy(tiny_kit, kind, fused, prompts):
    model = build(tiny_kit, kind)
    projections = ProjectionFusion(model) if fused else None
    reference = SlotDecoder(model, slots=8, max_len=32, device=CPU, cuda_graphs=False, projections=projections)
    direct = SlotDecoder(model, slots=8, max_len=32, device=CPU, cuda_graphs=False, projections=projections)
    first = 2  # rows 0, 1 are running requests: their slots must stay as they are
    generator = torch.Generator().manual_seed(5)
    for ref, new in zip(reference.keys + reference.values, direct.keys + direct.values, strict=True):
        ref.copy_(torch.randn(ref.shape, generator=generator))
        new.copy_(ref)
    with torch.inference_mode():
        want = hf_prefill(model, prompts, reference, first)
        got = direct.prefill(prompts, first_slot=first)
    assert got.shape == (len(prompts), model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(got[0], got[-1], atol=1e-3)  # rows differ: a row mix-up would show
    end = first + len(prompts)
    for layer in range(len(model.model.layers)):
        for ref, new in ((reference.keys[layer], direct.keys[layer]), (reference.values[layer], direct.values[layer])):
            for row, prompt in enumerate(prompts):  # positions 0 .. n-1 of each request's slot
                torch.testing.assert_close(new[first + row, :, :len(prompt)], ref[first + row, :, :len(prompt)],
                                           rtol=0, atol=1e-5)
            assert torch.equal(new[:first], ref[:first]) and torch.equal(new[end:], ref[end:])  # other slots kept


def test_slot_prefill_then_decode_scores_like_a_full_forward(tiny_kit):
    """Decoding on from the slot prefill's cache gives the logits of one forward over prompt + tokens."""
    model = build(tiny_kit, "qwen2")
    decoder = SlotDecoder(model, slots=6, max_len=32, device=CPU, cuda_graphs=False, projections=ProjectionFusion(model))
    follow = [[21, 22], [23, 24], [25, 26], [27, 28]]
    with torch.inference_mode():
        decoder.prefill(UNEQUAL, first_slot=1)
        steps = [decoder.decode(torch.tensor([0] + [f[s] for f in follow]), [0] + [len(p) + s for p in UNEQUAL])
                 for s in range(2)]
        for row, (prompt, tokens) in enumerate(zip(UNEQUAL, follow, strict=True)):
            full = model(torch.tensor([prompt + tokens])).logits[0, -2:]
            for s in range(2):
                torch.testing.assert_close(steps[s][row + 1], full[s], rtol=0, atol=1e-5)


def test_compiled_elementwise_kernels_serve_prefill_and_decode_shapes(tiny_kit):
    """On CUDA the add+RMSNorm, rotary and SiLU x up run compiled (dynamic shapes), and the prefill calls them
    with [R, W, ...] shapes the decode step never has (W > 1, rotary tables of batch 1). Compiled here with
    inductor's C++ backend, as `SlotDecoder.__init__` does on CUDA: the same logits and caches as eagerly, for
    several prefill groups (one row, one token) and the decode steps after them."""
    model = build(tiny_kit, "qwen3")
    projections = ProjectionFusion(model)
    eager, fused = (SlotDecoder(model, slots=8, max_len=32, device=CPU, cuda_graphs=False, projections=projections)
                    for _ in range(2))
    fused.fused = True  # what cuda_graphs=True sets on CUDA
    fused._add_norm_fn = torch.compile(add_rms_norm, dynamic=True)
    fused._rotate = torch.compile(fused._rotate, dynamic=True)
    fused._silu_mul = torch.compile(silu_mul, dynamic=True)
    groups = [(UNEQUAL, 0), ([[1, 2, 3, 4, 5, 6, 7]], 4), ([[40]], 5), ([[1, 2], [3, 4]], 6)]
    with torch.inference_mode():
        for prompts, first in groups:
            torch.testing.assert_close(fused.prefill(prompts, first), eager.prefill(prompts, first), rtol=0, atol=1e-5)
        lengths = [len(p) for prompts, _ in groups for p in prompts]
        for step in range(2):
            tokens = torch.arange(len(lengths)) + 7
            positions = [n + step for n in lengths]
            torch.testing.assert_close(fused.decode(tokens, positions), eager.decode(tokens, positions),
                                       rtol=0, atol=1e-5)
    for a, b in zip(eager.keys + eager.values, fused.keys + fused.values, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_slot_prefill_refuses_what_the_cache_cannot_hold(tiny_kit):
    decoder = SlotDecoder(build(tiny_kit, "qwen2"), slots=4, max_len=8, device=CPU, cuda_graphs=False)
    with pytest.raises(ValueError, match="the cache has 4 slots of 8 positions"):
        decoder.prefill([[1, 2]] * 3, first_slot=2)
    with pytest.raises(ValueError, match="up to 9 tokens"):
        decoder.prefill([list(range(9))], first_slot=0)


# ------------------------------------------------------------------ the engine, with and without it


@pytest.fixture(scope="module")
def engines(tiny_kit):
    pair = {flag: BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), random_seed=3, kv_cache="slots",
                                           disable_slot_prefill=flag)) for flag in (False, True)}
    yield pair
    for engine in pair.values():
        engine.shutdown()


def _generate(engine, prompts_first, prompts_late, temperature):
    """A group of unequal prompts, then a second group into the slots after it while it decodes. Each group is one
    batched body (submitted together, admitted as one group). The model thread pauses itself right after the first
    group's prefill and resumes once the late group waits, past the admission window, so the late group joins the
    four running rows however loaded the machine is (waiting on step counts instead let a loaded machine finish
    the first group first: CI saw the late group at slot 3, then at slot 0)."""
    scheduler = engine.scheduler

    def body(prompts, new_tokens):
        return {"input_ids": prompts, "return_logprob": True,
                "sampling_params": [{"max_new_tokens": new_tokens + 3 * i, "temperature": temperature,
                                     "sampling_seed": sum(p), "ignore_eos": True} for i, p in enumerate(prompts)]}

    real_prefill = scheduler._prefill

    def prefill_then_pause(requests, generate=True):
        real_prefill(requests, generate)
        if len(requests) == len(prompts_first):
            scheduler.pause()

    async def go():
        first = asyncio.ensure_future(engine.generate(body(prompts_first, 14)))
        while not scheduler.paused:
            await asyncio.sleep(0.002)
        late = asyncio.ensure_future(engine.generate(body(prompts_late, 8)))
        while len(scheduler._waiting) < len(prompts_late):
            await asyncio.sleep(0.002)
        await asyncio.sleep(5 * scheduler.admission_window_s)  # the late group is closed: admitted at the next step
        scheduler.resume()
        return await first + await late

    scheduler._prefill = prefill_then_pause
    try:
        return asyncio.run(go())
    finally:
        del scheduler._prefill  # the class's method again


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_engine_generates_the_same_with_and_without_the_slot_prefill(engines, monkeypatch, temperature):
    tok = engines[False].tokenizer
    first = [tok.encode(f"{i}+{i * 37}=") for i in range(1, 4)] + [tok.encode("a much longer prompt: 1234+5678=")]
    late = [tok.encode("late: 99+1="), tok.encode("7*7=")]
    prefills, forwards = [], {flag: 0 for flag in engines}
    original = SlotDecoder.prefill

    def spied(self, prompts, first_slot):
        prefills.append((len(prompts), first_slot))
        return original(self, prompts, first_slot)

    monkeypatch.setattr(SlotDecoder, "prefill", spied)
    hooks = [engine.model.register_forward_pre_hook(lambda *_, flag=flag: forwards.__setitem__(flag, forwards[flag] + 1))
             for flag, engine in engines.items()]
    try:
        replies = {flag: _generate(engine, first, late, temperature) for flag, engine in engines.items()}
    finally:
        for hook in hooks:
            hook.remove()
    assert forwards[False] == 0 and forwards[True] >= 2  # the transformers forward ran only with the flag
    assert prefills == [(4, 0), (2, 4)]  # the late group went into the slots after the first group's four rows
    for with_it, without in zip(replies[False], replies[True], strict=True):
        assert with_it["output_ids"] == without["output_ids"]
        gaps = [abs(a[0] - b[0]) for a, b in zip(with_it["meta_info"]["output_token_logprobs"],
                                                  without["meta_info"]["output_token_logprobs"], strict=True)]
        assert max(gaps) < 1e-5


@pytest.mark.parametrize("slot_prefill", [True, False], ids=["slot", "transformers"])
def test_a_failed_prefill_fails_its_admitted_requests_and_the_engine_serves_on(engines, monkeypatch, slot_prefill):
    """An admitted group is neither waiting nor running while it prefills (an H100 run lost one that way to an
    out-of-memory error: its clients waited forever): the failure reaches each of its requests, and the
    next request is served."""
    engine = engines[not slot_prefill]
    scheduler = engine.scheduler
    where = "_prefill_slots" if slot_prefill else "_merge"
    real = getattr(scheduler, where)
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (stand-in)")
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler, where, fail_once)

    async def go():
        group = {"input_ids": [[5, 6, 7], [8, 9, 10, 11]], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        failed = await asyncio.wait_for(asyncio.gather(engine.generate(group), return_exceptions=True), timeout=30)
        after = await asyncio.wait_for(engine.generate({"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True}}), timeout=30)
        return failed[0], after

    failed, after = asyncio.run(go())
    assert isinstance(failed, RuntimeError) and "out of memory" in str(failed)
    assert len(after["output_ids"]) == 4 and len(calls) == 2
    assert scheduler._admitting == []


def test_prompt_scoring_keeps_the_transformers_prefill(engines):
    """logprob_start_len >= 0 needs every position's logits: that group runs the transformers forward."""
    engine = engines[False]
    calls = []
    hook = engine.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        out = asyncio.run(engine.generate({"input_ids": [5, 6, 7, 8], "return_logprob": True, "logprob_start_len": 0,
                                           "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}))
    finally:
        hook.remove()
    assert calls and len(out["meta_info"]["input_token_logprobs"]) == 4
    assert out["meta_info"]["completion_tokens"] == 3


def test_the_flag_reaches_the_scheduler_and_server_info(tiny_kit, engines):
    from slime.engines.builtin.server import build_parser, engine_args_from

    assert engine_args_from(build_parser().parse_args(["--model", "m", "--disable-slot-prefill"])).disable_slot_prefill
    assert not engine_args_from(build_parser().parse_args(["--model", "m"])).disable_slot_prefill
    for flag, engine in engines.items():
        assert engine.scheduler.slot_prefill is not flag
        assert engine.server_info()["internal_states"][0]["slot_prefill"] is not flag
    dynamic = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), kv_cache="dynamic"))
    try:
        assert dynamic.scheduler.slot_prefill is False  # no slots to prefill into
    finally:
        dynamic.shutdown()


# ------------------------------------------------------------------ chunked prefill (--chunked-prefill-size)


@pytest.mark.parametrize(("lengths", "limit", "chunks"), [
    ([3, 5, 2, 8], 10, [(0, 2), (2, 3), (3, 4)]),  # 2 x 5 fits, 3 x 5 does not; 2 x 8 does not
    ([4, 4, 4, 4], 8, [(0, 2), (2, 4)]),
    ([20, 1], 10, [(0, 1), (1, 2)]),  # a prompt over the limit is a chunk of its own
    ([3, 5, 2, 8], -1, [(0, 4)]),  # no limit: the whole group
])
def test_prefill_chunks_bound_rows_times_the_longest_prompt(engines, lengths, limit, chunks, monkeypatch):
    scheduler = engines[False].scheduler
    monkeypatch.setattr(scheduler, "chunked_prefill_size", limit)
    assert scheduler._prefill_chunks(lengths) == chunks


def test_a_group_over_the_chunk_size_is_prefilled_in_chunks_and_generates_the_same(tiny_kit, engines, monkeypatch):
    """Six prompts under a limit of two rows' worth of padded tokens: three slot prefills at slots 0, 2 and 4, and
    the tokens and log-probs of one unchunked prefill."""
    tok = engines[False].tokenizer
    prompts = [tok.encode(f"{i}+{i + 10}=") for i in range(10, 16)]
    assert len({len(p) for p in prompts}) == 1  # one length: 2 rows per chunk
    limit = 2 * len(prompts[0])
    chunked = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), random_seed=3, kv_cache="slots",
                                       chunked_prefill_size=limit))
    calls = []
    original = SlotDecoder.prefill

    def spied(self, chunk, first_slot):
        calls.append((len(chunk), first_slot))
        return original(self, chunk, first_slot)

    monkeypatch.setattr(SlotDecoder, "prefill", spied)
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": [{"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
                                for i in range(len(prompts))]}
    try:
        split = asyncio.run(chunked.generate(body))
        assert calls == [(2, 0), (2, 2), (2, 4)]
        calls.clear()
        whole = asyncio.run(engines[False].generate(body))
        assert calls == [(6, 0)]
    finally:
        chunked.shutdown()
    for a, b in zip(split, whole, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x[0] - y[0]) for x, y in zip(a["meta_info"]["output_token_logprobs"],
                                                    b["meta_info"]["output_token_logprobs"], strict=True)) < 1e-5


def test_chunked_prefill_size_flag_and_its_refusal(tiny_kit):
    from slime.engines.builtin.server import build_parser, engine_args_from
    from slime.errors import ConfigError

    args = engine_args_from(build_parser().parse_args(["--model", "m", "--chunked-prefill-size", "4096"]))
    assert args.chunked_prefill_size == 4096
    assert engine_args_from(build_parser().parse_args(["--model", "m"])).chunked_prefill_size == 32768
    with pytest.raises(ConfigError, match="--chunked-prefill-size"):
        BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), chunked_prefill_size=0))
