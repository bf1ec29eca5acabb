"""GPU weight sync into a built-in engine on CUDA (run on the GPU machine: pytest -m gpu).

The engine runs on the last GPU (cuda:1 on a 2-GPU machine: a device index other than 0 is what
catches code that assumes `cuda` = cuda:0 on one of the engine's threads). The trainer side is this
process with an HF copy of the kit's model, changed by noise: tensor mode (colocated) sends CUDA IPC
handles from the engine's GPU, distributed mode broadcasts over NCCL from cuda:0 (a rank per GPU).
Afterwards the engine's prompt log-probs and its graph-captured decoding (slot cache, CUDA graphs: the
weights must have been copied in place) match this process's model within bf16 tolerance.

History: on two H200s (2026-11-21) both sync cases got an HTTP 500 from /generate after the sync. The
engine's model thread never made the engine's GPU its current device, so its first decode captured
CUDA graphs and recorded events on cuda:0 while the model was on cuda:1 (one GPU hides this: cuda:0
is right there). `test_engine_on_the_last_gpu_decodes_like_the_model` checks that without any sync.
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
TOKENS = [52, 43, 53, 61, 49, 50, 44]


@pytest.fixture(scope="module")
def engine(tiny_kit, tmp_path_factory):
    """(url, device) of a built-in engine on the last GPU with the slot cache and CUDA graphs."""
    device = f"cuda:{torch.cuda.device_count() - 1}"
    process, url = start_builtin_engine(str(tiny_kit.model_dir), log_path=tmp_path_factory.mktemp("gpu") / "e.log",
                                        device=device, dtype="bfloat16", kv_cache="slots")
    yield url, torch.device(device)
    process.stop()


def local_log_probs(model, tokens):
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device=device)).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tokens[1:], device=device)[:, None])[:, 0].cpu()


def check_engine_matches(url, model, version):
    """The engine's prompt scoring and its greedy decode agree with `model` and report `version`."""
    with httpx.Client(timeout=120, trust_env=False) as http:
        scored = http.post(f"{url}/generate", json={"input_ids": TOKENS, "return_logprob": True,
                                                    "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
        generated = http.post(f"{url}/generate", json={"input_ids": TOKENS, "return_logprob": True,
                                                       "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                           "ignore_eos": True}})
    assert scored.status_code == 200 and generated.status_code == 200, (scored.text, generated.text)
    scored, generated = scored.json(), generated.json()
    assert scored["meta_info"]["weight_version"] == version
    engine_prompt = torch.tensor([lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][1:]])
    assert (engine_prompt - local_log_probs(model, TOKENS)).abs().max() < BF16_TOLERANCE
    full = TOKENS + generated["output_ids"]
    engine_decode = torch.tensor([lp for lp, _, _ in generated["meta_info"]["output_token_logprobs"]])
    assert (engine_decode - local_log_probs(model, full)[len(TOKENS) - 1:]).abs().max() < BF16_TOLERANCE


def test_engine_on_the_last_gpu_decodes_like_the_model(engine, tiny_kit):
    url, device = engine
    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.bfloat16).to(device).eval()
    check_engine_matches(url, model, "default")


@pytest.mark.parametrize("mode", ["tensor", pytest.param("distributed", marks=pytest.mark.gpu2)])
def test_gpu_sync_matches_trainer_model(engine, tiny_kit, mode):
    url, engine_device = engine
    if mode == "distributed" and torch.cuda.device_count() < 2:
        pytest.fail("NCCL needs the trainer and the engine on different GPUs: run on a 2-GPU machine")
    # colocated tensor mode shares the engine's GPU; the NCCL rank 0 is on a GPU of its own
    trainer_device = engine_device if mode == "tensor" else torch.device("cuda", 0)
    with torch.cuda.device(trainer_device):  # the syncer sends from the current device
        model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.bfloat16).to(trainer_device)
        model.eval()
        generator = torch.Generator(device=trainer_device).manual_seed(3)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator, device=trainer_device).to(param.dtype))
        syncer = WeightSyncer(SyncConfig(weight_sync_mode=mode, update_weight_buffer_size=1 << 20))

        async def run():
            try:
                return await syncer.sync([url], lambda: iter(model.state_dict().items()), f"gpu-{mode}")
            finally:
                await syncer.close()

        result = asyncio.run(run())
    print(f"{mode}: {result.bytes / 1e6:.1f} MB, {result.buckets} buckets, {result.seconds}")
    check_engine_matches(url, model, f"gpu-{mode}")


def test_colocated_cycle_release_resume_sync(engine, tiny_kit):
    """The RL loop's colocated cycle on the engine, twice: release its memory (rollout done), resume it
    (training done), tensor-sync the trained weights, decode. Each round's weights must be the engine's."""
    url, device = engine
    with torch.cuda.device(device):
        model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.bfloat16).to(device).eval()
        generator = torch.Generator(device=device).manual_seed(5)
        syncer = WeightSyncer(SyncConfig(weight_sync_mode="tensor"))

        async def cycles():
            try:
                for round_ in range(2):
                    with httpx.Client(timeout=120, trust_env=False) as http:
                        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
                            assert http.post(f"{url}{path}", json={}).status_code == 200, path
                    with torch.no_grad():
                        for param in model.parameters():
                            noise = torch.randn(param.shape, generator=generator, device=device)
                            param.add_(0.05 * noise.to(param.dtype))
                    await syncer.sync([url], lambda: iter(model.state_dict().items()), f"cycle-{round_}")
                    check_engine_matches(url, model, f"cycle-{round_}")
            finally:
                await syncer.close()

        asyncio.run(cycles())
