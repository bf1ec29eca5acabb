"""Plugins the rollout tests name by dotted path (`rollout_plugins.<fn>`; pytest puts this directory on
sys.path). Each has slime's signature unless its name says it is broken."""

from __future__ import annotations

from slime.types import Sample

CALLS: dict[str, list] = {"sample_filter": [], "all_samples": []}


async def rm_parity(args, sample: Sample) -> float:
    """Even groups get rewards 0 and 1 (non-zero std), odd groups 1 and 1 (zero std): a reward-std
    filter drops exactly the odd groups."""
    return float(sample.index % 2) if sample.group_index % 2 == 0 else 1.0


async def rm_one(args, sample: Sample) -> float:
    return 1.0


async def rm_raises_on_index_1_mod_8(args, sample: Sample) -> float:
    """Fails one group in four (two samples a group): failed groups never come four in a row, which would stop
    the step (`max(rollout_batch_size, over_sampling_batch_size)` = 4 failures in a row raise), whatever order
    the groups finish in. One in two (index % 4) could: a run where four failing groups finished before the
    good ones between them failed the test."""
    if sample.index % 8 == 1:
        raise ValueError(f"grader crashed on sample {sample.index}")
    return 1.0


def mark_short_removed(args, data) -> None:
    """rollout_sample_filter_path: flag samples shorter than 3 tokens (none, with ignore-eos-free runs)."""
    CALLS["sample_filter"].append(len(data))
    for group in data:
        for sample in group:
            sample.remove_sample = sample.response_length < 0


def record_all_samples(args, all_samples, data_source) -> None:
    CALLS["all_samples"].append(len(all_samples))


async def generate_missing_param(args, sample):
    return sample


def generate_not_async(args, sample, sampling_params):
    return sample


def filter_wrong_arity(args):
    return True


async def generate_too_long(args, sample, sampling_params):
    """Returns a 10-token response whatever the budget: the rollout must cut it to the limit."""
    sample.tokens = [49, 43, 50, 61] + list(range(70, 80))
    sample.response_length = 10
    sample.loss_mask = [1] * 10
    sample.rollout_log_probs = [-1.0] * 10
    sample.response = "x" * 10
    sample.status = Sample.Status.COMPLETED
    return sample


async def rm_first_of_four(args, sample: Sample) -> float:
    """Exactly one correct sample in every 4 consecutive indices: pass@1 = 0.25, pass@2 = 0.5, pass@4 = 1."""
    return 1.0 if sample.index % 4 == 0 else 0.0


async def generate_with_own_client(args, sample: Sample, sampling_params):
    """A plugin that calls the router itself, from `args` alone (as slime plugins do)."""
    import httpx

    from slime.rollout.multiturn import append_model_output

    sample.tokens = sample.tokens or [49, 43, 50, 61]
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        reply = await client.post(url, json={"input_ids": sample.tokens, "sampling_params": sampling_params,
                                             "return_logprob": True})
    reply.raise_for_status()
    append_model_output(args, sample, reply.json())
    sample.metadata["seen"] = {"temperature": args.rollout_temperature, "params": dict(sampling_params)}
    return sample


async def group_rm_by_position(args, samples) -> list:
    """--group-rm: one call scores the whole group; reward = position in the group."""
    return [float(i) for i in range(len(samples))]


async def generate_fan_out(args, sample: Sample, sampling_params):
    """Default generation, then two trainable fragments per trajectory (slime's fan-out shape)."""
    import copy

    from slime.rollout.generate import generate

    sample = await generate(args, sample, sampling_params)
    twin = copy.deepcopy(sample)
    twin.metadata["fragment"] = 1
    return [sample, twin]


def my_rollout(args, rollout_id, data_source, evaluation=False):
    """A rollout_function_path plugin wrapping the default one."""
    from slime.rollout import generate_rollout

    out = generate_rollout(args, rollout_id, data_source, evaluation)
    out.metrics["custom"] = True
    return out


def rollout_missing_data_source(args, rollout_id):
    return None


async def generate_pretokenized(args, sample: Sample, sampling_params):
    """The default generate for samples that arrive with prompt tokens: no tokenizer (hf_checkpoint) needed."""
    from slime.rollout.generate import generate

    assert sample.tokens, "generate_pretokenized expects samples with tokens"
    return await generate(args, sample, sampling_params)
