"""Megatron response log-probs equal HF teacher-forced log-probs (fp32, CPU): what keeps the
train/rollout mismatch near zero, since the engine matches HF the same way. The two models' parity runs
(logprob_parity.py) go two at a time (script_rows.run_scripts)."""

import pytest
import torch
from script_rows import run_scripts
from transformers import AutoModelForCausalLM, Qwen2Config

from slime.backends.megatron.logprobs import pad_samples, response_positions
from slime.data.tiny import build_tokenizer
from slime.errors import ConfigError
from slime.types import Sample


@pytest.fixture(scope="module")
def parity(tiny_kit, tmp_path_factory):
    """logprob_parity.py's row (a Future) for the tiny kit ("kit") and for a model whose vocabulary of 300
    Megatron pads to 384 ("padded")."""
    padded = tmp_path_factory.mktemp("padded-vocab")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(padded)
    build_tokenizer().save_pretrained(padded)
    return run_scripts({"kit": ("logprob_parity.py", tiny_kit.model_dir), "padded": ("logprob_parity.py", padded)},
                       timeout=300)


def test_tiny_kit_log_probs_match_hf(parity):
    row = parity["kit"].result()[0]
    assert row["max_gap"] < 1e-5 and row["entropy_gap"] < 1e-4, row


def test_padded_vocabulary_is_excluded(parity):
    # vocab 300 is padded to 384 inside Megatron; padded entries must not take probability mass
    row = parity["padded"].result()[0]
    assert row["padded_vocab"] == 384 and row["vocab"] == 300
    assert row["max_gap"] < 1e-5, row


def test_response_positions_and_padding():
    samples = [Sample(tokens=[1, 2, 3, 4, 5], response_length=2), Sample(tokens=[7, 8], response_length=1),
               Sample(tokens=[9, 9, 9], response_length=0)]
    batch = pad_samples(samples, pad_token_id=0)
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5], [7, 8, 0, 0, 0], [9, 9, 9, 0, 0]]
    positions, mask = response_positions(batch)
    # sample 0: prompt 3 -> responses 4 and 5 are scored by logits at positions 2 and 3
    assert positions[0].tolist() == [2, 3] and mask[0].tolist() == [True, True]
    assert positions[1, 0].item() == 0 and mask[1].tolist() == [True, False]
    assert mask[2].tolist() == [False, False]
    with pytest.raises(ConfigError, match="no prompt token"):
        pad_samples([Sample(tokens=[1, 2], response_length=2)])
    # the lengths are kept on the host too (read per micro-batch without waiting for the GPU)
    assert batch.host_prompt_lengths == (3, 1, 3) and batch.host_response_lengths == (2, 1, 0)
    assert batch.max_response_length == 2


def test_a_batch_built_by_hand_gets_its_host_lengths_from_the_tensors():
    from slime.backends.megatron.logprobs import PaddedBatch

    batch = PaddedBatch(tokens=torch.zeros(2, 5, dtype=torch.long), prompt_lengths=torch.tensor([3, 2]),
                        response_lengths=torch.tensor([2, 3]))
    assert batch.host_prompt_lengths == (3, 2) and batch.host_response_lengths == (2, 3)
    assert batch.max_response_length == 3


def test_rows_to_host_keeps_order_lengths_and_gaps():
    from slime.backends.megatron.logprobs import rows_to_host

    rows = [torch.tensor([1.0, 2.0]), None, torch.zeros(0), torch.tensor([3.0], dtype=torch.bfloat16)]
    host = rows_to_host(rows)
    assert host[1] is None and host[2].shape == (0,)
    assert host[0].tolist() == [1.0, 2.0] and host[3].tolist() == [3.0] and host[3].dtype == torch.float32
    host[0][0] = 9.0  # each row its own tensor: writing one leaves the others alone
    assert host[3].tolist() == [3.0] and rows_to_host([None, None]) == [None, None] and rows_to_host([]) == []
