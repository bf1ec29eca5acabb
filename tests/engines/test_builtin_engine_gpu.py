"""The built-in engine on CUDA (run on a GPU machine: pytest -m gpu)."""

import asyncio

import pytest
import torch

from slime.engines.builtin.engine import BuiltinEngine, EngineArgs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_cache", ["slots", "dynamic"])
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 0.1)])
def test_cuda_logprobs_match_teacher_forced(tiny_kit, dtype, tolerance, kv_cache):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    engine = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), device="cuda", dtype=dtype,
                                      kv_cache=kv_cache))
    # slots on CUDA: graph-captured decode steps
    assert engine.scheduler.kv_cache == kv_cache
    try:
        prompts = [engine.tokenizer.encode(f"{i}+{i * 13}=") for i in range(1, 17)]

        async def go():
            return await asyncio.gather(*[engine.generate({
                "input_ids": p, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 16 + i, "ignore_eos": True}}) for i, p in enumerate(prompts)])

        outs = asyncio.run(go())
        worst = 0.0
        for prompt, out in zip(prompts, outs, strict=True):
            ids = torch.tensor([prompt + out["output_ids"]], device="cuda")
            with torch.no_grad():
                logits = engine.model(ids).logits[0].float()
            ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(
                1, torch.tensor(out["output_ids"], device="cuda").unsqueeze(1)).squeeze(1)
            got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], device="cuda")
            worst = max(worst, (got - ref).abs().max().item())
        if kv_cache == "slots":
            assert engine.scheduler._slots.cuda_graphs and engine.scheduler._slots._graphs
            assert engine.scheduler.decodes_ahead > 0  # the overlapped schedule ran (rows left mid-flight)
        print(f"{dtype} {kv_cache}: max |engine - teacher forced| = {worst:.2e}")
        assert worst < tolerance
    finally:
        engine.shutdown()


def test_cuda_memory_budget_caps_the_engine_and_sizes_its_slots(tiny_kit):
    """--mem-fraction-static (cluster.share_gpu): a 160 MiB part of the GPU holds fewer than the default 256
    slots; generation runs inside it, and an allocation past it fails in this process."""
    from slime.engines.builtin.memory import fitting_slots, slot_bytes

    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = 160 * 2**20 / total
    engine = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), device="cuda", dtype="bfloat16",
                                      kv_cache="slots", mem_fraction_static=fraction))
    try:
        decided = engine.memory_budget
        per_slot = slot_bytes(engine.model, engine.scheduler.context_length)
        assert decided["slots"] == engine.scheduler.max_running_requests < 256
        assert decided["slots"] == fitting_slots(decided["budget_bytes"], decided["weights_bytes"], per_slot)

        async def go():
            return await asyncio.gather(*[engine.generate({
                "input_ids": engine.tokenizer.encode(f"{i}+{i}="), "sampling_params": {
                    "max_new_tokens": 64, "ignore_eos": True}}) for i in range(200)])

        outs = asyncio.run(go())
        assert all(len(o["output_ids"]) == 64 for o in outs)
        assert torch.cuda.max_memory_reserved() <= decided["budget_bytes"]
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(decided["budget_bytes"], dtype=torch.uint8, device="cuda")
    finally:
        engine.shutdown()
        torch.cuda.set_per_process_memory_fraction(1.0)


def _staged(decoder, rows: int, generator: torch.Generator, mix: str) -> torch.Tensor:
    """A host input buffer with per-row sampling parameters of the given mix."""
    from slime.engines.builtin.slots import INPUT_ROWS

    host = decoder.stage()
    pick = lambda *values: torch.tensor(values)[torch.randint(len(values), (rows,), generator=generator)]  # noqa: E731
    columns = {
        "temperature": pick(1.0) if mix == "plain" else pick(0.0, 0.7, 1.0, 1.3),
        "top_p": pick(1.0) if mix == "plain" else pick(1.0, 0.9, 0.5),
        "top_k": pick(-1) if mix == "plain" else pick(-1, 1, 5, 50),
        "uniform": torch.rand(rows, dtype=torch.float64, generator=generator),
        "position": torch.randint(0, 100, (rows,), generator=generator),
    }
    for name, values in columns.items():
        host[INPUT_ROWS.index(name), :rows] = values.double()
    return host


@pytest.mark.parametrize("mix", ["plain", "truncating"])
def test_cuda_graph_sampler_draws_what_the_eager_sampler_draws(tiny_kit, mix):
    """The sampler captured in the decode graph (static inputs, no host sync) gives the tokens and
    log-probs of `sample` run eagerly on the same graph's logits with the same uniforms."""
    from transformers import AutoModelForCausalLM

    from slime.engines.builtin.sampling import sample
    from slime.engines.builtin.slots import SlotDecoder

    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).cuda().eval()
    decoder = SlotDecoder(model, slots=32, max_len=256, device=torch.device("cuda"), cuda_graphs=True)
    generator = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for rows in (3, 8, 20, 32):
            tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=generator).cuda()
            host = _staged(decoder, rows, generator, mix)
            params = host[:4, :rows].clone()
            logits = decoder.decode(tokens, host, rows)
            want_tokens, want_logprobs = sample(logits, params[0].float(), params[1].float(), params[2].long(),
                                                params[3])
            got_tokens, packed = decoder.decode_sample(tokens, host, rows, truncate=mix != "plain")
            assert torch.equal(got_tokens, want_tokens)
            assert torch.equal(packed[:, 0].long(), want_tokens)
            assert torch.allclose(packed[:, 1].float(), want_logprobs, atol=1e-6, rtol=0)
    assert any(truncate for _, _, truncate in decoder._graphs) == (mix != "plain")


def test_cuda_greedy_top_k_and_top_p_requests_run_in_the_graph(tiny_kit):
    """Greedy, top-k and top-p rows sampled inside the decode graph: greedy equals top_k=1 and the
    teacher-forced argmax (fp32), top-p log-probs are those of the renormalised nucleus (>= the full
    distribution's), and min_new_tokens (the eager fallback) still holds."""
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    engine = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), device="cuda", dtype="float32",
                                      kv_cache="slots"))
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(f"{i}*{i + 3}=") for i in range(6)]

        def body(prompt, **params):
            return {"input_ids": prompt, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, **params}}

        async def go():
            return await asyncio.gather(
                *[engine.generate(body(p, temperature=0)) for p in prompts],
                *[engine.generate(body(p, top_k=1)) for p in prompts],
                *[engine.generate(body(p, top_p=0.5, temperature=0.9)) for p in prompts],
                *[engine.generate(body(p, min_new_tokens=8, ignore_eos=False)) for p in prompts])

        outs = asyncio.run(go())
        greedy, top1, nucleus, banned = outs[:6], outs[6:12], outs[12:18], outs[18:]
        for prompt, g, k in zip(prompts, greedy, top1, strict=True):
            assert g["output_ids"] == k["output_ids"]
            ids = torch.tensor([prompt + g["output_ids"]], device="cuda")
            with torch.no_grad():
                logits = engine.model(ids).logits[0].float()
            steps = logits[len(prompt) - 1 : -1]
            top2 = steps.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # not a near-tie that fp32 rounding may flip
            assert clear.any()
            assert steps.argmax(-1)[clear].tolist() == torch.tensor(g["output_ids"], device="cuda")[clear].tolist()
        for prompt, out in zip(prompts, nucleus, strict=True):
            ids = torch.tensor([prompt + out["output_ids"]], device="cuda")
            with torch.no_grad():
                full = torch.log_softmax(engine.model(ids).logits[0].float() / 0.9, -1)[len(prompt) - 1 : -1]
            full = full.gather(1, torch.tensor(out["output_ids"], device="cuda").unsqueeze(1)).squeeze(1)
            got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], device="cuda")
            assert bool((got >= full - 1e-5).all())
        eos = engine.scheduler.eos_ids
        for out in banned:
            assert not eos & set(out["output_ids"][:8])
        assert any(truncate for _, _, truncate in engine.scheduler._slots._graphs)
    finally:
        engine.shutdown()
