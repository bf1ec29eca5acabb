"""A bf16 train rank keeps the weights it loaded until it trains, through the colocated cycle
(train_actor_cycle.py; CPU in CI, CUDA with -m gpu, where offload and onload move real memory).

History: the first GPU pipeline run (2026-11-25, H100) trained RL from the SFT checkpoint, and after the
first step every reward was 0. In bf16 megatron-core's optimizer keeps fp32 main copies of the weights,
taken when it is built, before the checkpoint is loaded; its first step wrote them (Megatron's random
init) back over the loaded model. bf16 on CPU shows it too, so the CPU case guards it in CI.

One module fixture runs every process the tests read, two at a time (as script_rows.run_scripts does, with the
starts after their cycle): the full-model cycle once, whose saved rank the plain, --finetune and
--no-load-optim starts all load, and the LoRA cycle with its resume.
"""

from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from script_rows import rows_by_case, run_script


@pytest.fixture(scope="module")
def cycles(tiny_kit, tmp_path_factory) -> dict[str, Future]:
    """The rows by case of each run, keyed "full", "lora" (the cycles, each saving to its own work dir) and
    "load", "load --finetune", "load --no-load-optim", "load --lora" (started from those saves). Futures: a failed
    run fails the tests that read it (a start from a failed cycle raises the cycle's error)."""
    full, lora = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("lora")

    def run(work, *flags: str) -> dict:
        return rows_by_case(run_script("train_actor_cycle.py", tiny_kit.model_dir, work, *flags, timeout=600))

    with ThreadPoolExecutor(max_workers=2) as pool:
        def start_from(cycle: Future, work, *flags: str) -> Future:
            def load() -> dict:
                cycle.result()  # the cycle's error, if it failed: there is no checkpoint to start from
                return run(work, "--load", *flags)

            # submitted after `cycle`, so `cycle` is running or done when `load` waits on it: no deadlock
            return pool.submit(load)

        runs = {"full": pool.submit(run, full), "lora": pool.submit(run, lora, "--lora")}
        runs["load"] = start_from(runs["full"], full)
        runs["load --finetune"] = start_from(runs["full"], full, "--finetune")
        runs["load --no-load-optim"] = start_from(runs["full"], full, "--no-load-optim")
        runs["load --lora"] = start_from(runs["lora"], lora, "--lora")
    return runs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_weights_survive_offload_and_a_step_at_lr_zero(cycles, device):
    if (device == "cuda") != torch.cuda.is_available():
        pytest.fail(f"the {device} case runs where the train rank uses {device}: -m gpu on the GPU machine, "
                    "the default selection elsewhere")
    rows = cycles["full"].result()
    cycle = rows["offload/onload"]
    assert cycle["moved"] == 0.0
    # the KL reference model is parked whole with the rest; full fine-tuning freezes nothing
    assert cycle["ref_slots"] == cycle["ref_tensors"] > 0 and cycle["frozen_slots"] == cycle["frozen_params"] == 0
    # one data-parallel rank: megatron's DDP buffers hold no copy of the weights (no distributed optimizer), so
    # offload parks every trainable parameter itself (the CUDA case once found the policy's weights left behind)
    assert cycle["policy_slots"] == cycle["trainable_params"] > 0, cycle
    if device == "cuda":  # policy and reference off the GPU: what stays is small against their weights, once
        # what CUDA holds whatever the model (cuBLAS workspaces: 34 MB against this model's 4 MB) is set aside
        assert cycle["frozen_bytes"] > cycle["model_bytes"] / 3, cycle
        left = cycle["gpu_bytes_offloaded"] - cycle["gpu_bytes_fixed"]
        assert left < cycle["model_bytes"] / 10, (f"{left} bytes left on the GPU against {cycle['model_bytes']} of "
                                                  f"weights; the largest: {cycle['largest_live']}")
    assert rows["step 0"]["lr"] == 0.0 and rows["step 0"]["moved"] == 0.0, rows  # warmup starts at lr 0
    assert 0.0 < rows["step 1"]["moved"] < rows["step 2"]["moved"] < 0.01, rows
    # started from that trained checkpoint, the KL reference is the policy it loaded (not hf_checkpoint's
    # untrained weights: the GPU pipeline once read KL 6.0 at RL's first step)
    resumed = cycles["load"].result()
    assert resumed["kl to reference"]["start"] == 3 and resumed["kl to reference"]["kl"] == 0.0, resumed
    # a full resume: Adam's state of the three steps, and the schedule past its warmup
    assert resumed["kl to reference"]["adam_steps"] == 3.0 and resumed["kl to reference"]["lr"] > 0.0, resumed


def test_finetune_and_no_load_optim_shape_the_start_from_a_full_rl_checkpoint(cycles):
    """Megatron's --finetune: the checkpoint's weights only (rollout 0, fresh optimizer and schedule);
    --no-load-optim: its weights and rollout id, but a fresh optimizer and schedule (warmup from lr 0 again)."""
    rows = {flag: cycles[f"load {flag}"].result()["kl to reference"] for flag in ("--finetune", "--no-load-optim")}
    finetune, no_optim = rows["--finetune"], rows["--no-load-optim"]
    assert finetune["start"] == 0 and no_optim["start"] == 3, rows
    assert finetune["adam_steps"] == 0.0 and no_optim["adam_steps"] == 0.0, rows
    assert finetune["lr"] == 0.0 and no_optim["lr"] == 0.0, rows  # the warmup's first step, not the resumed lr
    assert finetune["kl"] == 0.0 and no_optim["kl"] == 0.0, rows  # the loaded weights are the policy


def test_lora_rank_trains_adapters_against_the_frozen_base(cycles):
    """LoRA in bf16: the base is the KL reference (KL exactly 0 before the adapters move, not after), only the
    adapters train, and a rank started from the LoRA checkpoint resumes with those adapters as its reference."""
    rows = cycles["lora"].result()
    cycle = rows["offload/onload"]
    assert cycle["moved"] == 0.0
    # the frozen base is parked with the optimizer (the reference is the base itself: no reference model)
    assert cycle["frozen_slots"] == cycle["frozen_params"] > 0 and cycle["ref_slots"] == cycle["ref_tensors"] == 0
    assert rows["step 0"]["rollout/kl"] == 0.0 and rows["step 0"]["moved"] == 0.0, rows  # lr 0: B stays 0
    assert rows["step 1"]["rollout/kl"] == 0.0 < rows["step 1"]["moved"], rows  # KL is taken before the step
    # k1 (the default kl_loss_type) is a signed estimate: after a 1e-4 move in bf16 its sign is rounding's
    assert rows["step 2"]["rollout/kl"] != 0.0 and rows["step 2"]["moved"] > rows["step 1"]["moved"], rows
    assert rows["step 2"]["lora/rank"] == 4.0 and rows["step 2"]["lora/peak_memory_bytes"] > 0
    assert 0 < rows["step 2"]["lora/trainable_params"] < rows["step 2"]["lora/total_params"] / 10, rows
    resumed = cycles["load --lora"].result()
    assert resumed["kl to reference"]["start"] == 3 and resumed["kl to reference"]["kl"] == 0.0, resumed
