"""train.fused_adam: torch's fused AdamW kernel in megatron's (torch fallback) optimizer, fp32 on CPU.

megatron wraps one torch AdamW (`wrapper.optimizer`); `use_fused_adam` only changes that optimizer's param
groups and where its `step` tensors live, so a stand-in wrapper holding a torch AdamW exercises it all.
"""

import copy
import importlib
import types

import pytest
import torch

from slime.backends.megatron import optimizer as opt
from slime.errors import ConfigError

HPARAMS = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)  # megatron passes these, no kernel choice


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((17, 9), (9,), (4, 4, 3))]


def wrapper(params: list[torch.nn.Parameter], fused: bool | None) -> types.SimpleNamespace:
    """What megatron builds without Apex/TE (`torch.optim.AdamW(params, **HPARAMS)`), kernel chosen as given."""
    adam = types.SimpleNamespace(optimizer=torch.optim.AdamW(params, **HPARAMS))
    if fused is not None:
        opt.use_fused_adam(adam, fused)
    return adam


def run_steps(adam: types.SimpleNamespace, params: list[torch.nn.Parameter], steps: range) -> None:
    for k in steps:
        g = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        adam.optimizer.step()


@pytest.fixture
def fused_calls(monkeypatch):
    """How many times torch's fused Adam implementation ran."""
    calls = []
    adam_module = importlib.import_module("torch.optim.adam")  # `torch.optim.adam` is not an attribute
    real = adam_module._fused_adam
    monkeypatch.setattr(adam_module, "_fused_adam", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("reference_foreach", [False, True])
def test_fused_adamw_steps_equal_the_default_kernels(fused_calls, reference_foreach):
    """Five AdamW steps (weight decay, bias correction) with the fused kernel give the parameters and moments of
    torch's for-loop (CPU default) and foreach (CUDA default) kernels to fp32 rounding."""
    fused_params, plain_params = make_params(), make_params()
    fused = wrapper(fused_params, True)
    plain = types.SimpleNamespace(optimizer=torch.optim.AdamW(plain_params, **HPARAMS, foreach=reference_foreach))
    run_steps(fused, fused_params, range(5))
    assert len(fused_calls) == 5  # the fused path ran, once per step
    run_steps(plain, plain_params, range(5))
    assert len(fused_calls) == 5  # and the reference did not take it
    moved = max((f - p0).abs().max().item() for f, p0 in zip(fused_params, make_params(), strict=True))
    assert moved > 0.04  # 5 steps at lr 1e-2 really move the weights
    for f, p in zip(fused_params, plain_params, strict=True):
        torch.testing.assert_close(f, p, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.optimizer.state[f][key], plain.optimizer.state[p][key],
                                       rtol=1e-6, atol=1e-9)
        assert fused.optimizer.state[f]["step"].item() == 5.0


def test_default_kernel_is_left_as_megatron_builds_it(fused_calls):
    params = make_params()
    adam = wrapper(params, False)
    assert all(g["fused"] is None and g["foreach"] is None for g in adam.optimizer.param_groups)
    run_steps(adam, params, range(2))
    assert not fused_calls


def test_init_state_puts_steps_where_the_kernel_wants_them():
    """`init_optimizer_state` (before a checkpoint of a fresh optimizer) makes float32 steps, one per parameter,
    on the parameter's device for the fused kernel (CPU here) and on the CPU otherwise."""
    for fused in (True, False):
        params = make_params()
        adam = wrapper(params, fused)
        opt.init_optimizer_state(adam)
        steps = [adam.optimizer.state[p]["step"] for p in params]
        assert all(s.dtype == torch.float32 and s.device == p.device and s.item() == 0 for s, p in zip(steps, params, strict=True))
        assert len({id(s) for s in steps}) == len(steps)


@pytest.mark.parametrize(("saved_fused", "loaded_fused"), [(True, True), (False, True), (True, False)])
def test_a_load_keeps_the_chosen_kernel_and_resumes_bit_exactly(fused_calls, saved_fused, loaded_fused):
    """torch's load_state_dict takes `fused`/`foreach` from the saved groups; the post-hook puts back the kernel
    chosen for this optimizer. Same kernel: steps 3..4 after a load equal the uninterrupted run bit for bit."""
    params = make_params()
    saved = wrapper(params, saved_fused)
    run_steps(saved, params, range(2))
    state = copy.deepcopy(saved.optimizer.state_dict())  # its tensors are the live state: steps 3..4 change them
    snapshot = [p.detach().clone() for p in params]
    run_steps(saved, params, range(2, 4))

    resumed_params = [torch.nn.Parameter(s.clone()) for s in snapshot]
    resumed = wrapper(resumed_params, loaded_fused)
    resumed.optimizer.load_state_dict(state)
    groups = resumed.optimizer.param_groups
    assert all(g["fused"] is (True if loaded_fused else None) for g in groups)
    steps = [resumed.optimizer.state[p]["step"] for p in resumed_params]
    assert all(s.item() == 2 and s.dtype == torch.float32 for s in steps) and len({id(s) for s in steps}) == 3
    before = len(fused_calls)
    run_steps(resumed, resumed_params, range(2, 4))
    assert len(fused_calls) - before == (2 if loaded_fused else 0)
    for a, b in zip(params, resumed_params, strict=True):
        if saved_fused == loaded_fused:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_adam_is_refused_where_megatron_has_no_torch_adam():
    sgd = types.SimpleNamespace(optimizer=torch.optim.SGD(make_params(), lr=0.1))
    with pytest.raises(ConfigError, match="train.fused_adam"):
        opt.use_fused_adam(sgd, True)
    opt.use_fused_adam(sgd, False)  # nothing to change


def test_fused_adam_default_follows_cuda():
    assert opt.fused_adam_default() is (torch.cuda.is_available() and _megatron_uses_torch_adam())


def _megatron_uses_torch_adam() -> bool:
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

    return USING_PYTORCH_OPTIMIZER
