"""Partial rollout against two built-in engines behind the real router: groups aborted mid-generation go
back to the data source with their tokens and continue in the next step as one continuous response.
"""

from __future__ import annotations

import pytest
import torch
from conftest import engine_requests
from transformers import AutoModelForCausalLM

from slime.data.prompts import load_prompts
from slime.data.source import RolloutDataSource
from slime.rollout import generate_rollout
from slime.types import Status

# Stop on ~10% of the vocabulary so responses end at different lengths: when the batch is full, other
# groups are mid-generation and the abort catches them with some tokens.
STOP_IDS = list(range(100, 140))


def partial_args(make_args, **extra):
    fields = dict(rollout_batch_size=1, over_sampling_batch_size=4, sglang_server_concurrency=4,
                  rollout_max_response_len=40, rollout_stop_token_ids=STOP_IDS, partial_rollout=True,
                  custom_rm_path="rollout_plugins.rm_one")
    return make_args(**{**fields, **extra})


def rollout_until_partial(args, data_source, tries=4):
    """Run steps until the buffer holds a sample with a partial response; {index: copy of that sample}."""
    for rollout_id in range(tries):
        out = generate_rollout(args, rollout_id, data_source)
        m = out.metrics
        assert m["rollout/groups/drawn"] == m["rollout/groups/kept"] + m["rollout/groups/to_buffer"] + \
            m["rollout/groups/filtered"] + m["rollout/groups/failed"] + m["rollout/groups/aborted_dropped"]
        assert m["rollout/groups/to_buffer"] == len(data_source.buffer)
        partial = {s.index: (rollout_id, s.tokens[:], s.rollout_log_probs[:], s.response_length)
                   for g in data_source.buffer for s in g if s.status is Status.ABORTED and s.response_length}
        if partial:
            return partial
    pytest.fail(f"no aborted sample with tokens after {tries} steps")


def resume(args, data_source, partial, first_id):
    """Run further steps until every partial sample has been kept in a step; {index: final sample}."""
    finished = {}
    for rollout_id in range(first_id, first_id + 8):
        out = generate_rollout(args, rollout_id, data_source)
        finished.update({s.index: s for g in out.samples for s in g if s.index in partial})
        if set(partial) <= set(finished):
            break
    return finished


def test_aborted_groups_continue_with_continuous_tokens_and_log_probs(make_args, tiny_kit):
    args = partial_args(make_args)
    data_source = RolloutDataSource(load_prompts(str(tiny_kit.train)), n_samples_per_prompt=2, args=args)
    partial = rollout_until_partial(args, data_source)
    first_id = max(v[0] for v in partial.values()) + 1
    finished = resume(args, data_source, partial, first_id)
    assert finished, "no partial sample was finished in later steps"
    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()
    for index, sample in finished.items():
        started_in, tokens, log_probs, length = partial[index]
        sample.validate()
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
        assert sample.tokens[: len(tokens)] == tokens  # the old response is the start of the new one
        assert sample.rollout_log_probs[:length] == log_probs
        assert length < sample.response_length <= 40
        assert sample.loss_mask == [1] * sample.response_length
        assert sample.metadata["start_rollout_id"] == started_in
        assert len(sample.weight_versions) >= 2  # one entry per engine call
        # continuity: the log-probs of the stitched response are what one pass of the model gives
        with torch.no_grad():
            logits = model(torch.tensor([sample.tokens])).logits[0, :-1].float()
        response = torch.tensor(sample.tokens[1:])[-sample.response_length:]
        recomputed = torch.log_softmax(logits, -1)[-sample.response_length:].gather(1, response[:, None])[:, 0]
        assert torch.allclose(recomputed, torch.tensor(sample.rollout_log_probs), atol=1e-4), index


def test_mask_offpolicy_zeroes_the_old_part_of_the_loss_mask(make_args, tiny_kit):
    args = partial_args(make_args, mask_offpolicy_in_partial_rollout=True)
    data_source = RolloutDataSource(load_prompts(str(tiny_kit.train)), n_samples_per_prompt=2, args=args)
    partial = rollout_until_partial(args, data_source)
    finished = resume(args, data_source, partial, max(v[0] for v in partial.values()) + 1)
    assert finished
    for index, sample in finished.items():
        # tokens from before the step that finished the sample are off-policy: a zero prefix at least as
        # long as the response it had when first aborted (longer if it came back more than once)
        zeros = sample.loss_mask.index(1) if 1 in sample.loss_mask else sample.response_length
        assert zeros >= partial[index][3]
        assert sample.loss_mask == [0] * zeros + [1] * (sample.response_length - zeros)
        assert len(sample.rollout_log_probs) == sample.response_length


def test_without_partial_rollout_aborted_groups_are_dropped_and_counted(make_args, tiny_kit, cluster):
    _, engines = cluster
    args = partial_args(make_args, partial_rollout=False)
    data_source = RolloutDataSource(load_prompts(str(tiny_kit.train)), n_samples_per_prompt=2, args=args)
    out = generate_rollout(args, 0, data_source)
    m = out.metrics
    assert len(out.samples) == 1 and data_source.buffer == []
    assert m["rollout/groups/to_buffer"] == 0 and m["rollout/groups/aborted_dropped"] == 3
    assert m["rollout/groups/drawn"] == 4
    assert engine_requests(engines) == [0, 0]
