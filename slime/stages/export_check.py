"""Does the exported HF directory answer the eval prompts as the evaluate stage scored them?

The evaluate stage serves a checkpoint through the engines and stores every eval sample with its
response and reward. `check_exported_answers` loads the exported directory with plain `transformers`
(no engine, no Megatron; a PEFT adapter directory, `slime export --merge false`, on its base through peft), greedily decodes the same prompt token ids, scores the answers with the same
reward function and compares sample by sample. It only applies to greedy evals (`eval_temperature`
0): sampled answers cannot be compared one by one.

Agreement is expected to be exact on CPU in fp32 (engine and `generate` compute the same argmax); a
disagreement names the prompts, so a broken export (wrong weight mapping, lost tokenizer, bad config)
shows up as answers that differ, not as a silently lower score.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from typing import Any

from slime.config import Config
from slime.errors import ConfigError, DataFormatError
from slime.storage import is_committed, read_manifest, read_samples
from slime.storage.fs import join_uri
from slime.storage.staging import local_copy
from slime.types import Sample

logger = logging.getLogger(__name__)

BATCH = 64
SHOWN_MISMATCHES = 5


def _trim(text: str, stops: list[str]) -> str:
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def _reward_value(reward: Any) -> float:
    return float(reward["score"] if isinstance(reward, dict) else reward or 0.0)


def _generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, stops: list[str]) -> list[str]:
    """Greedy answers for token-id prompts (left padded, batch by batch), cut at the first stop string."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    answers = []
    for start in range(0, len(prompts), BATCH):
        batch = prompts[start:start + BATCH]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
        for row in out[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[:row.index(tokenizer.eos_token_id)]
            answers.append(_trim(tokenizer.decode(row, skip_special_tokens=True), stops))
    return answers


def load_exported(path: str) -> tuple[Any, str]:
    """(fp32 model, tokenizer directory) of an export: an HF model directory, or a PEFT adapter directory
    (`slime export --merge false`) applied by peft to its base, `base_model_name_or_path` (a local HF directory)."""
    import torch
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(os.path.join(path, "config.json")):
        from peft import PeftConfig, PeftModel

        base = PeftConfig.from_pretrained(path).base_model_name_or_path
        if not base or not os.path.isfile(os.path.join(base, "config.json")):
            # slime export's manifest says why when the base is a trained Megatron checkpoint (lora_export.peft_base)
            why = (read_manifest(path).metadata.get("peft_base") or {}).get("warning") if is_committed(path) else None
            raise ConfigError(f"{path} is a PEFT adapter whose base_model_name_or_path {base!r} is not a local HF "
                              "model directory: the check cannot load its base" + (f" ({why})" if why else ""))
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        tokenizer = path if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else base
        return PeftModel.from_pretrained(model, path).eval(), tokenizer
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), path


def check_exported_answers(config: Config, hf_dir: str, eval_result: str, dataset: str) -> dict[str, Any]:
    """Compare `hf_dir`'s greedy answers with the samples of `dataset` in the committed eval result
    `eval_result`; returns counts, both accuracies (mean reward) and the first mismatches."""
    import torch
    from transformers import AutoTokenizer

    from slime.rollout.eval import dataset_args, dataset_sampling_params, eval_datasets

    args = config.as_namespace()
    by_name = {ds.name: ds for ds in eval_datasets(args)}
    if dataset not in by_name:
        raise ConfigError(f"eval dataset {dataset!r} is not in the config (eval datasets: {sorted(by_name)})")
    args = dataset_args(args, by_name[dataset])
    params = dataset_sampling_params(args, by_name[dataset])
    if params.get("temperature") != 0:
        raise ConfigError(f"eval dataset {dataset!r} is sampled at temperature {params.get('temperature')}: the "
                          "exported model's answers can only be compared one by one with a greedy eval "
                          "(eval_temperature 0)")
    uri = join_uri(eval_result, dataset)
    samples = read_samples(uri, config.run.storage_options)
    if not samples:
        raise DataFormatError(f"{uri}: the eval result holds no samples for dataset {dataset!r}")
    stops = list(params.get("stop") or [])
    max_new = params["max_new_tokens"]
    hf_dir = local_copy(config, hf_dir)  # an export in a remote store: its staged download
    model, tokenizer_dir = load_exported(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if torch.cuda.is_available():
        model = model.to("cuda")
    prompts = [s.tokens[: len(s.tokens) - s.response_length] for s in samples]
    answers = _generate(model, tokenizer, prompts, max_new, stops)

    from slime.rollout.rewards.hub import compute_reward

    async def score(answer: str, sample: Sample) -> float:
        again = copy.copy(sample)
        again.response, again.reward = answer, None
        return _reward_value(await compute_reward(args, again))

    async def score_all() -> list[float]:
        return list(await asyncio.gather(*(score(a, s) for a, s in zip(answers, samples, strict=True))))

    hf_rewards = asyncio.run(score_all())
    eval_rewards = [_reward_value(s.reward) for s in samples]
    same_answer = [_trim(s.response, stops) == a for s, a in zip(samples, answers, strict=True)]
    mismatches = [{"prompt": s.prompt if isinstance(s.prompt, str) else str(s.prompt), "eval": s.response,
                   "exported": a, "label": s.label}
                  for s, a, same in zip(samples, answers, same_answer, strict=True) if not same][:SHOWN_MISMATCHES]
    result = {
        "dataset": dataset, "prompts": len(samples), "same_answer": sum(same_answer),
        "same_reward": sum(h == e for h, e in zip(hf_rewards, eval_rewards, strict=True)),
        "accuracy_exported": sum(hf_rewards) / len(samples), "accuracy_eval": sum(eval_rewards) / len(samples),
        "mismatches": mismatches,
    }
    logger.info("exported model %s on %s: %d/%d answers as evaluated, accuracy %.4f (eval %.4f)", hf_dir, dataset,
                result["same_answer"], len(samples), result["accuracy_exported"], result["accuracy_eval"])
    return result
