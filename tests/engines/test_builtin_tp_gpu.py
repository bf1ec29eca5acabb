"""The built-in engine with tensor parallelism on two GPUs (NCCL; all-reduces captured in the decode graphs): run on a
GPU machine with two GPUs, `pytest -m gpu2 tests/engines/test_builtin_tp_gpu.py`.

TP 2's log-probs are checked against the teacher-forced log-probs of the unsplit model (TP 1 engine's, on cuda:0),
within the single-GPU engine tests' bounds (tests/engines/test_builtin_engine_gpu.py: fp32 1e-4, bf16 0.1); in fp32
greedy tokens also equal TP 1's. A weight update goes through the NCCL broadcast to rank 1.
"""

import asyncio

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from slime.engines.builtin.engine import BuiltinEngine, EngineArgs

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2]


def teacher_forced(model, prompt, output_ids):
    ids = torch.tensor([prompt + output_ids], device="cuda:0")
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(
        1, torch.tensor(output_ids, device="cuda:0").unsqueeze(1)).squeeze(1)


def generate(engine, prompts, temperature):
    async def go():
        return await asyncio.gather(*[engine.generate({
            "input_ids": p, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12 + i, "temperature": temperature, "ignore_eos": True}})
            for i, p in enumerate(prompts)])

    return asyncio.run(go())


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 0.1)])
def test_tp2_on_two_gpus_matches_the_unsplit_model(tiny_kit, tmp_path, dtype, tolerance):
    if torch.cuda.device_count() < 2:
        pytest.fail("gpu2 test run with fewer than two GPUs")
    tp2 = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), device="cuda:0", dtype=dtype, tp_size=2))
    tp1 = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), device="cuda:0", dtype=dtype,
                                   kv_cache="slots"))
    try:
        prompts = [tp1.tokenizer.encode(f"{i}+{i * 7}=") for i in range(1, 13)]
        for temperature in (0.0, 1.0):
            got = generate(tp2, prompts, temperature)
            worst = 0.0
            for prompt, out in zip(prompts, got, strict=True):
                ref = teacher_forced(tp1.model, prompt, out["output_ids"])
                lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], device="cuda:0")
                worst = max(worst, (lps - ref).abs().max().item())
            print(f"{dtype} temperature {temperature}: max |TP 2 - teacher forced| = {worst:.2e}")
            assert worst < tolerance
            if dtype == "float32" and temperature == 0.0:
                assert [o["output_ids"] for o in got] == [o["output_ids"] for o in generate(tp1, prompts, 0.0)]
        slots = tp2.scheduler._slots
        assert slots.cuda_graphs and slots._graphs and tp2.scheduler.decodes_ahead > 0  # graphs + overlap ran

        # a weight update: rank 0 broadcasts the full tensors over NCCL, each rank copies its slice
        full = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).state_dict()
        generator = torch.Generator().manual_seed(3)
        moved = {n: (t + 0.05 * torch.randn(t.shape, generator=generator)).contiguous() for n, t in full.items()
                 if n != "lm_head.weight"}  # tied to the embeddings
        save_file(moved, str(tmp_path / "model.safetensors"))
        for engine in (tp2, tp1):
            assert engine.update_weights_from_disk(str(tmp_path), "v2")["success"]
        got = generate(tp2, prompts, 0.0)
        worst = max((torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]], device="cuda:0")
                     - teacher_forced(tp1.model, p, o["output_ids"])).abs().max().item()
                    for p, o in zip(prompts, got, strict=True))
        assert worst < tolerance
    finally:
        tp2.shutdown()
        tp1.shutdown()
