"""Random real-shape checkpoints: the shapes benchmarks and GPU tests rely on."""

import pytest
import torch

from slime.data.random_models import qwen2_config


def test_qwen2_sizes_have_their_parameter_counts():
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        counts = {size: sum(p.numel() for p in Qwen2ForCausalLM(qwen2_config(size)).parameters())
                  for size in ("0.5b", "1.5b")}
    # tied embeddings counted once: Qwen2.5-0.5B 494M, Qwen2.5-1.5B 1.54B
    assert counts == {"0.5b": 494_032_768, "1.5b": 1_543_714_304}


def test_unknown_size_is_refused():
    with pytest.raises(ValueError, match="unknown Qwen2 size '7b'"):
        qwen2_config("7b")
