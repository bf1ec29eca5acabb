"""Random real-shape checkpoints: the shapes benchmarks and GPU tests rely on."""

import pytest
import torch

from slime.data.random_models import qwen2_config


def test_qwen2_sizes_have_their_parameter_counts():
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        counts = {size: sum(p.numel() for p in Qwen2ForCausalLM(qwen2_config(size)).parameters())
                  for size in ("0.5b", "1.5b", "3b", "7b", "14b")}
    # the published Qwen2.5 sizes (tied embeddings counted once up to 3B; 7B and 14B have their own output layer)
    assert counts == {"0.5b": 494_032_768, "1.5b": 1_543_714_304, "3b": 3_085_938_688, "7b": 7_615_616_512,
                      "14b": 14_770_033_664}


def test_unknown_size_is_refused():
    with pytest.raises(ValueError, match="unknown Qwen2 size '70b'"):
        qwen2_config("70b")
