"""Run in a subprocess by test_megatron_sync.py (cpu_compat is process-global): a Megatron trainer
that changes its weights and syncs them into running built-in engines, once per mode.

    python megatron_sync.py HF_DIR WORK_DIR URL [URL ...]   -> one JSON line per mode

For each mode the weights get fresh noise, then the line records the engines' greedy output and
version before and after, the sync result, each engine's last weight update, and the trainer's and
every engine's log-probs of the same tokens.
"""

import asyncio
import json
import os
import sys

import httpx
import torch

from slime.backends.megatron.bridge import build_model, export_hf_weights, init_megatron, make_bridge
from slime.backends.megatron.logprobs import compute_log_probs
from slime.config import SyncConfig
from slime.sync import WeightSyncer
from slime.types import Sample

GREEDY = {"input_ids": [52, 43, 53, 61], "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                 "ignore_eos": True}}


def engine_log_probs(http: httpx.Client, url: str, sample: Sample) -> list[float]:
    """The engine's log-probs of the sample's response tokens, teacher-forced (prompt scoring)."""
    reply = http.post(f"{url}/generate", json={"input_ids": sample.tokens, "return_logprob": True,
                                               "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
    reply.raise_for_status()
    scored = reply.json()["meta_info"]["input_token_logprobs"]
    prompt = len(sample.tokens) - sample.response_length
    return [lp for lp, _, _ in scored[prompt:]]


def main() -> None:
    hf_dir, work_dir, urls = sys.argv[1], sys.argv[2], sys.argv[3:]
    init_megatron(seed=0)
    bridge = make_bridge(hf_dir)
    models = build_model(bridge, hf_dir)
    for model in models:
        model.eval()
    vocab = bridge.hf_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i, (prompt_len, response_len) in enumerate([(4, 8), (9, 5), (2, 12)]):
        tokens = torch.randint(0, vocab, (prompt_len + response_len,), generator=generator).tolist()
        samples.append(Sample(index=i, tokens=tokens, response_length=response_len))
    with httpx.Client(timeout=120, trust_env=False) as http:
        modes = os.environ.get("SLIME_SYNC_MODES", "disk,tensor,distributed").split(",")
        for step, mode in enumerate(modes, start=1):
            before = [http.post(f"{url}/generate", json=GREEDY).json() for url in urls]
            with torch.no_grad():  # the change a train step would make, bigger
                for model in models:
                    for param in model.parameters():
                        param.add_(0.05 * torch.randn(param.shape, generator=generator))
            buffer = int(os.environ.get("SLIME_SYNC_BUFFER_BYTES", 256 * 1024))
            config = SyncConfig(weight_sync_mode=mode, update_weight_buffer_size=buffer,
                                update_weight_disk_dir=f"{work_dir}/weights")
            syncer = WeightSyncer(config, hf_config=bridge.hf_config)
            result = asyncio.run(syncer.sync(urls, lambda: export_hf_weights(bridge, models), f"step-{step}"))
            after = [http.post(f"{url}/generate", json=GREEDY).json() for url in urls]
            updates = [http.get(f"{url}/server_info").json()["internal_states"][0] for url in urls]
            asyncio.run(syncer.close())
            groups_after_close = [http.get(f"{url}/server_info").json()["internal_states"][0]["weight_update_groups"]
                                  for url in urls]
            trainer = compute_log_probs(models, samples, vocab_size=vocab).log_probs
            engines = {url: [engine_log_probs(http, url, s) for s in samples] for url in urls}
            print(json.dumps({
                "mode": mode, "result": {"mode": result.mode, "weight_version": result.weight_version,
                                         "bytes": result.bytes, "buckets": result.buckets,
                                         "tensors": result.tensors, "seconds": result.seconds},
                "before": [(b["output_ids"], b["meta_info"]["weight_version"]) for b in before],
                "after": [(a["output_ids"], a["meta_info"]["weight_version"]) for a in after],
                "updates": [{"last": u["last_weight_update"], "paused": u["paused"],
                             "groups": u["weight_update_groups"]} for u in updates],
                "groups_after_close": groups_after_close,
                "trainer": [t.tolist() for t in trainer], "engines": engines}), flush=True)


if __name__ == "__main__":
    main()
