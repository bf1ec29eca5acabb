"""The built-in engine with tensor parallelism on two GPUs (NCCL; all-reduces captured in the decode graphs): run on a
GPU machine with two GPUs, `pytest -m gpu2 -s tests/engines/test_builtin_tp_gpu.py` (`-s`: the phases print as they go).

TP 2's log-probs are checked against the teacher-forced log-probs of the unsplit model (TP 1 engine's, on cuda:0),
within the single-GPU engine tests' bounds (tests/engines/test_builtin_engine_gpu.py: fp32 1e-4, bf16 0.1); in fp32
greedy tokens also equal TP 1's. A weight update goes through the NCCL broadcast to rank 1.

A first run on two H200s passed its 100 s limit with no output (pytest held it). So each phase (engine start, which
includes rank 1's start and the first NCCL all-reduce; the first generate, which includes the compiles and the decode
graphs' capture; the TP 1 reference; the weight update) prints when it starts and ends, flushed, to stdout and to
$SLIME_TP_GPU_LOG (default /tmp/slime-tp-gpu2.log, kept when pytest's output is lost), and has its own time limit
(PHASE_LIMITS_S). A phase past its limit writes every thread's stack of this process (rank 0) to that log, asks each
follower for its own (SIGUSR1: tp_worker.py registers faulthandler on it; they print to their stderr, which is this
process's) and exits the process: an NCCL collective that never ends cannot be interrupted from Python, and the log
then says which phase stopped and where each rank was.
"""

import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from slime.engines.builtin.engine import BuiltinEngine, EngineArgs

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2]

# seconds each phase may take (a loaded machine's imports, compiles and captures included)
PHASE_LIMITS_S = {"start TP 2": 240, "generate": 240, "start TP 1": 120, "compare": 240, "weight update": 180}
LOG = os.environ.get("SLIME_TP_GPU_LOG", "/tmp/slime-tp-gpu2.log")


def say(message):
    line = f"[tp-gpu2 {time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    with open(LOG, "a") as log:
        log.write(line + "\n")


@contextlib.contextmanager
def phase(name, engines=()):
    """Say when `name` starts and ends; past PHASE_LIMITS_S[name], dump every rank's stacks and exit (docstring)."""
    limit = PHASE_LIMITS_S[name.split(":")[0]]
    started = time.monotonic()
    done = threading.Event()

    def expire():
        if done.wait(limit):
            return
        say(f"phase {name!r} passed its {limit} s limit: stacks of rank 0 below, followers' on stderr")
        with open(LOG, "a") as log:
            faulthandler.dump_traceback(file=log, all_threads=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for engine in engines:
            for worker in getattr(engine.tp, "workers", []) if engine.tp is not None else []:
                with contextlib.suppress(OSError):
                    os.kill(worker.pid, signal.SIGUSR1)
                    say(f"asked follower pid {worker.pid} for its stacks")
        time.sleep(3)  # the followers write theirs
        os._exit(3)

    threading.Thread(target=expire, name=f"phase-{name}", daemon=True).start()
    say(f"phase {name!r} (limit {limit} s)")
    try:
        yield
    finally:
        done.set()
        say(f"phase {name!r} ended after {time.monotonic() - started:.1f} s")


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
    say(f"{dtype}: {torch.cuda.device_count()} GPUs, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')!r}, "
        f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    engines = []
    try:
        with phase("start TP 2: rank 1's start, the groups and the first NCCL all-reduce"):
            tp2 = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), device="cuda:0", dtype=dtype,
                                           tp_size=2))
            engines.append(tp2)
        say(f"TP 2 follower pids {[w.pid for w in tp2.tp.workers]}")
        with phase("start TP 1", engines):
            tp1 = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), device="cuda:0", dtype=dtype,
                                           kv_cache="slots"))
            engines.append(tp1)
        prompts = [tp1.tokenizer.encode(f"{i}+{i * 7}=") for i in range(1, 13)]
        for temperature in (0.0, 1.0):
            with phase(f"generate: TP 2 at temperature {temperature} (the first one compiles and captures the "
                       "decode graphs on both ranks)", engines):
                got = generate(tp2, prompts, temperature)
            with phase(f"compare: teacher-forced log-probs at temperature {temperature}", engines):
                worst = 0.0
                for prompt, out in zip(prompts, got, strict=True):
                    ref = teacher_forced(tp1.model, prompt, out["output_ids"])
                    lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
                                       device="cuda:0")
                    worst = max(worst, (lps - ref).abs().max().item())
                say(f"{dtype} temperature {temperature}: max |TP 2 - teacher forced| = {worst:.2e}")
                assert worst < tolerance
                if dtype == "float32" and temperature == 0.0:
                    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in generate(tp1, prompts, 0.0)]
        slots = tp2.scheduler._slots
        say(f"{len(slots._graphs)} decode graphs captured, {tp2.scheduler.decodes_ahead} decodes ahead")
        assert slots.cuda_graphs and slots._graphs and tp2.scheduler.decodes_ahead > 0  # graphs + overlap ran

        # a weight update: rank 0 broadcasts the full tensors over NCCL, each rank copies its slice
        with phase("weight update: NCCL broadcast of every full tensor to rank 1, then a greedy generate", engines):
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
            say(f"{dtype} after the update: max |TP 2 - teacher forced| = {worst:.2e}")
            assert worst < tolerance
    finally:
        for engine in reversed(engines):
            engine.shutdown()
        say(f"{dtype}: engines shut down")
