"""Run in a subprocess by test_lora_adapter_sync.py (cpu_compat is process-global): a Megatron trainer with
LoRA adapters takes two SFT steps, then syncs into two running built-in engines, merged (disk and tensor)
into engine 0 and adapter-only into engine 1, several times each (for the timings).

    python lora_adapter_sync.py HF_DIR WORK_DIR URL0 URL1 [REPEATS]   -> one JSON line

The line holds every sync's result, the trainer's log-probs of three samples, both engines' teacher-forced
log-probs of them, what the adapter directory held, and a last adapter sync that also sends the base.
"""

import asyncio
import json
import sys
from pathlib import Path

import httpx
import torch

from slime.backends.megatron import lora
from slime.backends.megatron.bridge import build_model, export_hf_weights, init_megatron, make_bridge
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.lora_export import peft_state_dict, write_peft_adapter
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.train import StepSettings, train_step
from slime.config import SyncConfig
from slime.sync import WeightSyncer
from slime.sync.adapter import ADAPTER_NAME
from slime.types import Sample

SPEC = lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
                     seed=3)


def engine_log_probs(http: httpx.Client, url: str, sample: Sample, **extra) -> list[float]:
    reply = http.post(f"{url}/generate", json={"input_ids": sample.tokens, "return_logprob": True,
                                               "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0},
                                               **extra})
    reply.raise_for_status()
    scored = reply.json()["meta_info"]["input_token_logprobs"]
    return [lp for lp, _, _ in scored[len(sample.tokens) - sample.response_length:]]


def record(result) -> dict:
    return {"mode": result.mode, "weight_version": result.weight_version, "bytes": result.bytes,
            "tensors": result.tensors, "seconds": result.seconds}


def main() -> None:
    hf_dir, work = sys.argv[1], Path(sys.argv[2])
    merged_url, adapter_url = sys.argv[3], sys.argv[4]
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    init_megatron(seed=0)
    bridge = make_bridge(hf_dir)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True, post_create=lora.lora_callback(SPEC))
    lora.set_base(models, hf_dir)
    vocab = bridge.hf_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i, (prompt_len, response_len) in enumerate([(4, 8), (9, 5), (2, 12)]):
        tokens = torch.randint(0, vocab, (prompt_len + response_len,), generator=generator).tolist()
        samples.append(Sample(index=i, tokens=tokens, response_length=response_len, loss_mask=[1] * response_len))
    optimizer = build_optimizer(models, lr=1e-2, clip_grad=1.0, adam_eps=1e-3)
    for _ in range(2):  # B moves off zero: the adapters change the model
        train_step(models, optimizer, samples, StepSettings(loss_type="sft_loss", micro_batch_size=2),
                   vocab_size=vocab)
    for model in models:
        model.eval()
    trainer = [t.tolist() for t in compute_log_probs(models, samples, vocab_size=vocab).log_probs]

    def write_adapter(state, out_dir):  # what TrainActor._write_adapter does
        write_peft_adapter(state, SPEC, out_dir, base_model=hf_dir, hf_config=bridge.hf_config)

    def adapters():
        return iter(peft_state_dict(bridge, models).items())

    def merged():
        return export_hf_weights(bridge, models)

    syncers = {
        "disk": ([merged_url], merged, WeightSyncer(SyncConfig(weight_sync_mode="disk",
                                                               update_weight_disk_dir=str(work / "merged")),
                                                    hf_config=bridge.hf_config)),
        "tensor": ([merged_url], merged, WeightSyncer(SyncConfig(weight_sync_mode="tensor"),
                                                      hf_config=bridge.hf_config)),
        "adapter": ([adapter_url], adapters, WeightSyncer(SyncConfig(lora_sync="adapter",
                                                                     update_weight_disk_dir=str(work / "adapters")),
                                                          hf_config=bridge.hf_config, write_adapter=write_adapter)),
    }
    results = {name: [] for name in syncers}
    for k in range(repeats):
        for name, (urls, weights, syncer) in syncers.items():
            results[name].append(record(asyncio.run(syncer.sync(urls, weights, f"{name}-{k}"))))
    listing = sorted(p.name for p in (work / "adapters").iterdir())
    adapter_files = sorted(p.name for p in (work / "adapters" / f"lora_adapter_adapter-{repeats - 1}").iterdir())
    with httpx.Client(timeout=120, trust_env=False) as http:
        engines = {"merged": [engine_log_probs(http, merged_url, s) for s in samples],
                   "adapter": [engine_log_probs(http, adapter_url, s, lora_path=ADAPTER_NAME) for s in samples]}
        # a syncer that also sends the base (as when the adapters' base is not the engines' HF checkpoint);
        # the engine holds the first syncer's adapter, which this one does not know of: best-effort unload
        def base():
            with lora.adapters_disabled(models):
                yield from export_hf_weights(bridge, models)

        with_base = WeightSyncer(SyncConfig(lora_sync="adapter", update_weight_disk_dir=str(work / "with-base")),
                                 hf_config=bridge.hf_config, write_adapter=write_adapter, adapter_base=base)
        based = record(asyncio.run(with_base.sync([adapter_url], adapters, "with-base")))
        engines["adapter_with_base"] = [engine_log_probs(http, adapter_url, s, lora_path=ADAPTER_NAME)
                                        for s in samples]
        server = http.get(f"{adapter_url}/server_info").json()["internal_states"][0]
    print(json.dumps({"results": results, "with_base": based, "trainer": trainer, "engines": engines,
                      "listing": listing, "adapter_files": adapter_files, "adapter_state": server["lora_adapters"],
                      "last_update": server["last_weight_update"]}), flush=True)


if __name__ == "__main__":
    main()
