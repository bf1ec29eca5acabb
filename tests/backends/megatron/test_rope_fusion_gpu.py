"""megatron's rotary fusion through torch's provider on CUDA in bf16 (pytest -m gpu): the compiled rotation at
the 1.5B query/key shapes (4096 positions, 12 and 2 heads of 128) within one bf16 rounding of the exact rotation,
forward and backward, and no further from it than megatron's unfused one; prints the errors and both timings.

Compared with megatron's values directly instead, it fails where the two products cancel (megatron rounds each
product, the fused kernel only the sum): the first version of this test did, on an H100; rope_reference.py."""

import time

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from rope_reference import check_rounded_once, forward_backward, llama_inputs

from slime.backends.megatron import rope_fusion
from slime.backends.megatron.bridge import fused_activation_available

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("heads", [12, 2])  # Qwen2 1.5B: 12 query heads, 2 key/value heads of 128
def test_compiled_rotary_is_the_exact_rotation_rounded_once_on_cuda(heads):
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    assert fused_activation_available()
    t, freqs, grad = llama_inputs(4096, heads, device="cuda")
    errors = check_rounded_once(t, freqs, grad)
    timings = {}
    for name, fn in (("fused", rope_fusion.fused_apply_rotary_pos_emb), ("megatron", rope_utils._apply_rotary_pos_emb_bshd)):
        for _ in range(3):
            forward_backward(fn, t, freqs, grad)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            forward_backward(fn, t, freqs, grad)
        torch.cuda.synchronize()
        timings[name] = (time.perf_counter() - start) / 50 * 1e3
    print({"heads": heads, "max_abs_error": errors, "ms_fwd_bwd": timings})
