"""megatron's gradient clipping without Apex/TE, on torch's foreach ops (optimizer.use_foreach_clipping): the
same norm and scaling as its per-tensor fallback, without a host read per gradient."""

import collections

import torch
from torch.profiler import ProfilerActivity, profile

from slime.backends.megatron.optimizer import _foreach_l2_norm, _foreach_scale, use_foreach_clipping


def _grads(n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3 + i, 5, generator=g) * (i + 1) for i in range(n)]


def test_norm_is_the_l2_norm_of_all_gradients_without_a_host_read_each():
    grads = _grads()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        norm, per_tensor = _foreach_l2_norm(2048 * 32, None, [grads], False)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    assert norm.shape == (1,) and norm.dtype == torch.float32 and per_tensor is None
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)
    ops = collections.Counter(e.name for e in prof.events())
    assert ops["aten::_local_scalar_dense"] == 0, ops  # megatron's fallback reads each norm back: one per tensor


def test_scale_in_place_and_into_other_tensors():
    grads = _grads()
    before = [g.clone() for g in grads]
    _foreach_scale(2048 * 32, None, [grads, grads], 0.25)  # clipping: [grads, grads]
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g, b * 0.25)
    out = [torch.empty_like(g) for g in grads]
    _foreach_scale(2048 * 32, None, [before, out], 2.0)
    for o, b in zip(out, before, strict=True):
        assert torch.equal(o, b * 2.0)


def test_installed_where_megatron_falls_back():
    from megatron.core.optimizer import clip_grads

    assert use_foreach_clipping()  # neither Apex nor Transformer Engine here
    assert clip_grads.l2_norm_impl is _foreach_l2_norm and clip_grads.multi_tensor_scale_impl is _foreach_scale
