"""Run in a subprocess by test_lora_adapter_sync.py: a LoRA `TrainActor` (fp32, no Ray) with
`sync.lora_sync: adapter` trains, syncs its adapters into a running built-in engine (`update_weights`), and
the rollout's own request (`generate_turn`, with `engine_lora_name` set as the rollout manager sets it)
reaches the adapter.

    python train_actor_adapter_sync.py HF_DIR WORK_DIR ENGINE_URL   -> one JSON line
"""

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx

from slime.backends.megatron.logprobs import compute_log_probs
from slime.config import Config
from slime.net import find_free_port
from slime.ray.train_actor import TrainActor
from slime.rollout.multiturn import generate_turn
from slime.storage import write_samples
from slime.sync.adapter import ADAPTER_NAME
from slime.types import Sample, Status


def rollout(uri: str) -> list[Sample]:
    """4 groups of 4 samples with rewards that differ inside each group (non-zero advantages)."""
    samples = []
    for g in range(4):
        for i in range(4):
            prompt, response = [65 + g, 66, 67], [48 + i % 10, 49, 50, 51]
            samples.append(Sample(group_index=g, index=g * 4 + i, prompt="p", tokens=prompt + response, response="r",
                                  response_length=len(response), label="1", reward=float(i % 2),
                                  loss_mask=[1] * len(response), rollout_log_probs=[-1.0] * len(response),
                                  status=Status.COMPLETED))
    write_samples(uri, samples)
    return samples


def main() -> None:
    hf_dir, work, url = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    config = Config.model_validate({
        "run": {"store": str(work), "run_id": "adapter-sync"}, "checkpoint": {"hf_checkpoint": hf_dir},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 2},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-2},
        "lora": {"lora_rank": 4, "lora_alpha": 8},
        "sync": {"lora_sync": "adapter", "update_weight_disk_dir": str(work / "adapters")}})
    actor = TrainActor(config.model_dump(mode="json"), 0, 1)
    actor.init(f"tcp://127.0.0.1:{find_free_port()}")
    port = int(url.rsplit(":", 1)[1])
    args = SimpleNamespace(sglang_router_ip="127.0.0.1", sglang_router_port=port, engine_lora_name=ADAPTER_NAME)
    rows = []
    with httpx.Client(timeout=120, trust_env=False) as http:
        for step in range(2):
            samples = rollout(str(work / f"rollout{step}"))
            actor.train(step, str(work / f"rollout{step}"))
            metrics = actor.update_weights([url], str(step + 1))
            trainer = compute_log_probs(actor.models, samples[:3], vocab_size=actor.bridge.hf_config.vocab_size)
            engine = []
            for sample in samples[:3]:
                reply = http.post(f"{url}/generate", json={
                    "input_ids": sample.tokens, "return_logprob": True, "logprob_start_len": 0,
                    "lora_path": ADAPTER_NAME, "sampling_params": {"max_new_tokens": 0}}).json()
                scored = reply["meta_info"]["input_token_logprobs"]
                engine.append([lp for lp, _, _ in scored[len(sample.tokens) - sample.response_length:]])
            prompt = Sample(index=0, tokens=[65, 66, 67], response_length=0)
            turn = asyncio.run(generate_turn(args, prompt, {"max_new_tokens": 3, "temperature": 0.0}))
            other = SimpleNamespace(**{**vars(args), "engine_lora_name": "not_loaded"})
            try:  # the field travels: an adapter name the engine lacks is refused
                asyncio.run(generate_turn(other, prompt, {"max_new_tokens": 3}))
                refused = ""
            except Exception as exc:
                refused = str(exc)
            rows.append({"metrics": {k: v for k, v in metrics.items() if k.startswith("sync/")},
                         "trainer": [t.tolist() for t in trainer.log_probs], "engine": engine,
                         "turn_version": turn["meta_info"]["weight_version"], "refused": refused,
                         "listing": sorted(p.name for p in (work / "adapters").iterdir())})
    print(json.dumps({"rows": rows}), flush=True)
    actor.close()


if __name__ == "__main__":
    main()
