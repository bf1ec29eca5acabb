"""GPU weight sync into a built-in engine on CUDA (run on the GPU machine: pytest -m gpu).

The trainer side is this process with an HF copy of the kit's model on the same GPU, changed by
noise: tensor mode sends CUDA IPC handles, distributed mode broadcasts over NCCL. Afterwards the
engine's prompt log-probs and its graph-captured decoding (slot cache, CUDA graphs: the weights must
have been copied in place) match this process's model within bf16 tolerance.
"""

import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.config import SyncConfig
from slime.engines.builtin.launcher import start_builtin_engine
from slime.sync import WeightSyncer

pytestmark = pytest.mark.gpu
BF16_TOLERANCE = 0.05  # log-prob gap for bf16 weights and kernels that differ between processes


@pytest.fixture(scope="module")
def engine(tiny_kit, tmp_path_factory):
    # the last GPU: with two, the engine sits on GPU 1 and this process (the trainer) on GPU 0, as NCCL
    # needs. Measured 2026-11-21: on one H100 the tensor (CUDA IPC) case passes; on two H200s both cases got
    # an HTTP 500 from the engine after the sync (not yet diagnosed; see issue 5)
    device = f"cuda:{torch.cuda.device_count() - 1}"
    process, url = start_builtin_engine(str(tiny_kit.model_dir), log_path=tmp_path_factory.mktemp("gpu") / "e.log",
                                        device=device, dtype="bfloat16", kv_cache="slots")
    yield url
    process.stop()


def local_log_probs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device="cuda")).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tokens[1:], device="cuda")[:, None])[:, 0]


@pytest.mark.parametrize("mode", ["tensor", pytest.param("distributed", marks=pytest.mark.gpu2)])
def test_gpu_sync_matches_trainer_model(engine, tiny_kit, mode):
    if mode == "distributed" and torch.cuda.device_count() < 2:
        pytest.fail("NCCL needs the trainer and the engine on different GPUs: run on a 2-GPU machine")
    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.bfloat16).cuda().eval()
    generator = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, device="cuda").to(param.dtype))
    syncer = WeightSyncer(SyncConfig(weight_sync_mode=mode, update_weight_buffer_size=1 << 20))

    async def run():
        try:
            return await syncer.sync([engine], lambda: iter(model.state_dict().items()), f"gpu-{mode}")
        finally:
            await syncer.close()

    result = asyncio.run(run())
    print(f"{mode}: {result.bytes / 1e6:.1f} MB, {result.buckets} buckets, {result.seconds}")
    tokens = [52, 43, 53, 61, 49, 50, 44]
    with httpx.Client(timeout=120, trust_env=False) as http:
        scored = http.post(f"{engine}/generate", json={"input_ids": tokens, "return_logprob": True,
                                                       "logprob_start_len": 0,
                                                       "sampling_params": {"max_new_tokens": 0}}).json()
        generated = http.post(f"{engine}/generate", json={"input_ids": tokens, "return_logprob": True,
                                                          "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                              "ignore_eos": True}}).json()
    assert scored["meta_info"]["weight_version"] == f"gpu-{mode}"
    engine_prompt = torch.tensor([lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][1:]])
    assert (engine_prompt - local_log_probs(model, tokens).cpu()).abs().max() < BF16_TOLERANCE
    full = tokens + generated["output_ids"]
    engine_decode = torch.tensor([lp for lp, _, _ in generated["meta_info"]["output_token_logprobs"]])
    assert (engine_decode - local_log_probs(model, full)[len(tokens) - 1:].cpu()).abs().max() < BF16_TOLERANCE
