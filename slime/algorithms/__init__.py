"""RL math as plain torch functions: tensors in, tensors out, no config objects.

Layout shared by every module here: a batch of responses is a right-padded ``[B, T]`` tensor
(row = sample, column t = response token t) plus a ``mask`` of the same shape, true (or 1) where
the token is trained: padding and ``Sample.loss_mask == 0`` tokens (tool output, ...) are false.
Values at masked positions are never read, so they may hold anything (padding, NaN, inf); every
per-token output is 0 there. Per-sample scalars (rewards) are ``[B]``.

- ``kl``: approximate KL estimators k1, k2, k3, low_var_kl.
- ``rewards``: group reward normalisation (GRPO-style mean/std over the samples of one prompt).
- ``advantages``: token advantages and returns per estimator, and masked whitening.
- ``policy_loss``: PPO/GSPO/CISPO surrogates, TIS weights, value, entropy and SFT losses.
- ``reduce``: per-token losses to a scalar (per-sample mean, or per-token mean).

Reference: THUDM/slime ``slime/utils/ppo_utils.py`` and ``slime/backends/megatron_utils/loss.py``.
"""
