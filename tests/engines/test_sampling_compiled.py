"""The compiled sampler (`compiled_draw`, the CUDA default) draws what the eager sampler draws.

Inductor's C++ backend compiles it here on the CPU. One graph per (vocabulary, temperature scaling),
shared by every row count from 2 up (a single row is drawn eagerly): the graph counter of dynamo says so.
"""

import asyncio

import pytest
import torch
from torch._dynamo.utils import counters

from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.engines.builtin.sampling import sample


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


def inputs(rows: int, vocab: int, seed: int, *, scaled: bool):
    """Peaked and flat rows, some tokens banned (-inf, as min_new_tokens does), host parameter tensors."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * torch.linspace(0.5, 12, rows).unsqueeze(1)
    logits[::2, ::5] = float("-inf")
    temperatures = torch.rand(rows, generator=generator) * 1.5 + 0.2 if scaled else torch.ones(rows)
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    return logits, temperatures, torch.ones(rows), torch.full((rows,), -1, dtype=torch.long), uniforms


def assert_same_draws(args) -> None:
    eager_tokens, eager_logprobs = sample(*args)
    tokens, logprobs = sample(*args, compiled=True)
    assert torch.equal(tokens, eager_tokens)
    assert (logprobs - eager_logprobs).abs().max().item() < 1e-5
    assert bool(torch.isfinite(logprobs).all())  # never a banned token


# 9496 = 8 x 1187 (Qwen2's block size), 2503 (prime: padded blocks of 1024), 5000 (blocks of 1000). Each
# compiles a graph (the first one in a process ~40 s on 2 CPU cores with a cold inductor cache): two run in CI
@pytest.mark.parametrize("vocab, scaled", [(9496, False), (2503, True), pytest.param(5000, False, marks=pytest.mark.slow),
                                           pytest.param(5000, True, marks=pytest.mark.slow)])
def test_compiled_draw_equals_eager_for_any_row_count(vocab, scaled):
    before = graphs()
    for rows in (3, 64, 1, 17):
        assert_same_draws(inputs(rows, vocab, seed=rows, scaled=scaled))
    # compiled once for this vocabulary and scaling, at 3 rows; 64 and 17 reuse the graph, 1 row is eager
    assert graphs() - before == 1


@pytest.mark.slow
def test_compiled_draw_equals_eager_at_qwen2_vocabulary():
    before = graphs()
    for rows in (2, 64):
        assert_same_draws(inputs(rows, 151936, seed=rows, scaled=False))
    assert graphs() - before == 1


@pytest.mark.parametrize("case", ["greedy row", "top-k row", "top-p row"])
def test_greedy_and_truncated_rows_stay_eager(case):
    logits, temperatures, top_ps, top_ks, uniforms = inputs(8, 2503, seed=1, scaled=True)
    if case == "greedy row":
        temperatures[3] = 0
    elif case == "top-k row":
        top_ks[3] = 5
    else:
        top_ps[3] = 0.5
    before = graphs()
    eager = sample(logits, temperatures, top_ps, top_ks, uniforms)
    compiled = sample(logits, temperatures, top_ps, top_ks, uniforms, compiled=True)
    assert graphs() == before  # nothing compiled: the eager path ran
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    if case == "greedy row":
        assert compiled[0][3] == logits[3].argmax()


def test_engine_samples_the_same_with_the_compiled_sampler(tiny_kit):
    """Through the scheduler (forced on here; on by default only on CUDA): seeded requests in one batch
    get the same tokens and log-probs with and without it."""
    engine = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), random_seed=7, kv_cache="slots"))
    assert not engine.scheduler.compile_sampler  # CPU: eager unless forced
    assert engine.server_info()["internal_states"][0]["sampler_compiled"] is False
    prompts = [engine.tokenizer.encode(f"{i}+{i * 13}=") for i in range(1, 5)]

    async def generate_all():
        return await asyncio.gather(*[
            engine.generate({"input_ids": p, "return_logprob": True,
                             "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": i}})
            for i, p in enumerate(prompts)])

    try:
        eager = asyncio.run(generate_all())
        engine.scheduler.compile_sampler = True
        before = graphs()
        compiled = asyncio.run(generate_all())
        assert graphs() > before  # the compiled draw ran
    finally:
        engine.shutdown()
    for a, b in zip(eager, compiled, strict=True):
        assert a["output_ids"] == b["output_ids"]
        gaps = [abs(x[0] - y[0]) for x, y in zip(a["meta_info"]["output_token_logprobs"],
                                                  b["meta_info"]["output_token_logprobs"], strict=True)]
        assert max(gaps) < 1e-5


def test_engine_flag_turns_the_compiled_sampler_off():
    from slime.engines.builtin.server import build_parser, engine_args_from

    args = engine_args_from(build_parser().parse_args(["--model", "m", "--disable-sampler-compile"]))
    assert args.disable_sampler_compile
    assert not engine_args_from(build_parser().parse_args(["--model", "m"])).disable_sampler_compile


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_bf16_logits_draw_what_their_fp32_upcast_draws(compiled):
    """The slot decoder hands the step's logits in the model's dtype (no fp32 copy): the sampler upcasts them
    itself, so a bf16 step draws exactly what its fp32 upcast would, on every path."""
    logits, temperatures, top_ps, top_ks, uniforms = inputs(6, 2503, seed=3, scaled=True)
    half = logits.to(torch.bfloat16)
    for top_p in (1.0, 0.7):  # the common path, and the truncated one (eager always)
        params = (temperatures, torch.full((6,), top_p), top_ks, uniforms)
        want = sample(half.float(), *params)
        got = sample(half, *params, compiled=compiled)
        assert torch.equal(got[0], want[0]) and got[1].dtype == torch.float32
        assert (got[1] - want[1]).abs().max().item() < 1e-5
