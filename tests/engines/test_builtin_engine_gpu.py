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
