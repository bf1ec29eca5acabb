"""Train-step inputs: TrainArrays validation, micro-batch tensors, and refusals before any forward."""

import pytest
import torch

from slime.backends.megatron.step_data import TrainArrays, build_micro_batch
from slime.backends.megatron.train import StepSettings, train_step
from slime.errors import ConfigError, DataFormatError
from slime.types import Sample


def samples() -> list[Sample]:
    return [Sample(index=0, tokens=[5, 6, 7, 8], response_length=2, loss_mask=[0, 1], rollout_log_probs=[-1.0, -2.0],
                   metadata={"advantage": 0.5}),
            Sample(index=1, tokens=[1, 2, 3, 4, 9], response_length=3, rollout_log_probs=[-0.1, -0.2, -0.3],
                   metadata={"advantage": -1.0})]


def test_micro_batch_tensors():
    xs = samples()
    arrays = TrainArrays(ref_log_probs=[[-3.0, -4.0], torch.tensor([-5.0, -6.0, -7.0])])
    micro = build_micro_batch(xs, [0, 1], arrays, pad_token_id=0, device=torch.device("cpu"))
    assert micro.batch.tokens.tolist() == [[5, 6, 7, 8, 0], [1, 2, 3, 4, 9]]
    assert micro.loss_mask.tolist() == [[False, True, False], [True, True, True]]
    # scalar advantages from Sample.metadata broadcast over each response, 0 in the padding
    assert micro.advantages.tolist() == [[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]]
    assert torch.allclose(micro.rollout_log_probs, torch.tensor([[-1.0, -2.0, 0.0], [-0.1, -0.2, -0.3]]))
    assert micro.ref_log_probs.tolist() == [[-3.0, -4.0, 0.0], [-5.0, -6.0, -7.0]]
    assert micro.old_log_probs is None and micro.returns is None and micro.rollout_rows.tolist() == [True, True]
    # a sample without rollout log-probs: zeros in its row, marked so (the reused-log-prob metrics skip it)
    xs[0].rollout_log_probs = None
    mixed = build_micro_batch(xs, [0, 1], TrainArrays(), pad_token_id=0, device=torch.device("cpu"))
    assert mixed.rollout_rows.tolist() == [False, True] and mixed.rollout_log_probs[0].tolist() == [0.0, 0.0, 0.0]
    xs[1].rollout_log_probs = None
    assert build_micro_batch(xs, [0, 1], TrainArrays(), pad_token_id=0, device=torch.device("cpu")).rollout_log_probs \
        is None
    xs = samples()
    # per-token advantages replace the scalar path; a scalar entry still broadcasts
    per_token = build_micro_batch(xs, [1, 0], TrainArrays(advantages=[[1.0, 2.0], 3.0]), pad_token_id=0,
                                  device=torch.device("cpu"))
    assert per_token.advantages.tolist() == [[3.0, 3.0, 3.0], [1.0, 2.0, 0.0]]


def test_train_arrays_lengths_are_checked():
    with pytest.raises(DataFormatError, match="sample index=1: TrainArrays.old_log_probs has 2 values"):
        TrainArrays(old_log_probs=[[0.0, 0.0], [0.0, 0.0]]).check(samples())
    with pytest.raises(DataFormatError, match="returns has 1 entries for 2 samples"):
        TrainArrays(returns=[[0.0, 0.0]]).check(samples())


@pytest.mark.parametrize(("settings", "arrays", "error", "match"), [
    (StepSettings(loss_type="custom_loss"), None, ConfigError, "loss_type 'custom_loss'"),
    (StepSettings(loss_type="policy_loss", use_kl_loss=True, kl_loss_coef=0.1), None, ConfigError, "ref_log_probs"),
    (StepSettings(loss_type="value_loss"), None, ConfigError, "returns"),
    (StepSettings(loss_type="sft_loss", reuse_log_probs=True), None, ConfigError, "reuse_log_probs"),
    (StepSettings(loss_type="policy_loss", reuse_log_probs=True),
     TrainArrays(old_log_probs=[[0.0, 0.0], [0.0, 0.0, 0.0]]), ConfigError, "no TrainArrays.old_log_probs"),
])
def test_train_step_refuses_missing_inputs(settings, arrays, error, match):
    with pytest.raises(error, match=match):
        train_step([], None, samples(), settings, vocab_size=16, arrays=arrays)


def test_rollout_log_probs_required_for_tis():
    xs = samples()
    xs[1].rollout_log_probs = None
    with pytest.raises(DataFormatError, match="sample index=1: use_tis needs rollout_log_probs"):
        train_step([], None, xs, StepSettings(loss_type="policy_loss", use_tis=True), vocab_size=16)
    with pytest.raises(ConfigError, match="at least one sample"):
        train_step([], None, [], StepSettings(), vocab_size=16)


def test_step_settings_from_config():
    from slime.config import load_config

    config = load_config(None, ["--advantage-estimator", "gspo", "--eps-clip-c", "3", "--use-kl-loss",
                                "--kl-loss-coef", "0.01", "--kl-loss-type", "k3", "--use-tis", "--tis-clip", "1.5",
                                "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--micro-batch-size", "4",
                                "--rollout-temperature", "0.7", "--calculate-per-token-loss", "--entropy-coef", "0.001"])
    s = StepSettings.from_config(config)
    assert (s.loss_type, s.advantage_estimator, s.eps_clip_c, s.kl_loss_type, s.kl_loss_coef) == \
        ("policy_loss", "gspo", 3.0, "k3", 0.01)
    assert s.use_kl_loss and s.use_tis and s.tis_clip == 1.5 and s.calculate_per_token_loss
    assert (s.use_dynamic_batch_size, s.max_tokens_per_gpu, s.micro_batch_size) == (True, 4096, 4)
    assert s.temperature == 0.7 and s.entropy_coef == 0.001
    assert StepSettings.from_config(config, loss_type="value_loss").loss_type == "value_loss"


def test_whiten_over_dp_on_one_rank_equals_whiten():
    from slime.algorithms.advantages import whiten
    from slime.backends.megatron.whiten import whiten_over_dp

    xs = samples()  # loss masks [0, 1] and all ones
    raw = [torch.tensor([5.0, 1.0]), torch.tensor([2.0, -3.0, 4.0])]
    got = whiten_over_dp(xs, raw)
    padded = torch.tensor([[5.0, 1.0, 0.0], [2.0, -3.0, 4.0]])
    mask = torch.tensor([[False, True, False], [True, True, True]])
    expected = whiten(padded, mask)
    assert got[0].tolist()[0] == 0.0  # untrained token
    assert torch.allclose(got[0], expected[0, :2], atol=1e-6) and torch.allclose(got[1], expected[1], atol=1e-6)


def test_stack_and_split_rows():
    from slime.backends.megatron.step_data import split_rows, stack_rows

    xs = samples()
    padded, mask = stack_rows(xs, [[1.0, 2.0], torch.tensor([3.0, 4.0, 5.0])])
    assert padded.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]
    assert mask.tolist() == [[False, True, False], [True, True, True]]
    assert [r.tolist() for r in split_rows(padded * 2, xs)] == [[2.0, 4.0], [6.0, 8.0, 10.0]]
    assert stack_rows(xs)[0] is None
