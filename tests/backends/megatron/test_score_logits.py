"""`score_logits` (the fused `ResponseScores`) equals the plain formula it replaced: gather the scoring
positions, fp32, divide by the temperature, cut the padded vocabulary, log-softmax, gather the targets
(entropy: `entropy_from_logits`); values and gradients, fp32 and bf16, on CPU."""

import pytest
import torch

from slime.algorithms.policy_loss import entropy_from_logits
from slime.backends.megatron import logprobs
from slime.backends.megatron.logprobs import pad_samples, response_positions, score_logits
from slime.types import Sample

VOCAB, PADDED = 37, 48  # Megatron pads the vocabulary; the padded columns are not tokens


@pytest.fixture(autouse=True)
def one_tensor_parallel_rank(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)


def plain_scores(logits, batch, temperature, with_entropy, vocab=VOCAB):
    """The unfused formula: a gathered fp32 `[B, R, V]` copy of the scoring logits."""
    positions, mask = response_positions(batch)
    seq = batch.tokens.shape[1]
    targets = batch.tokens.gather(1, (positions + 1).clamp(max=seq - 1))
    scoring = logits.gather(1, positions.unsqueeze(2).expand(-1, -1, logits.shape[2])).float() / temperature
    scoring = scoring[..., :vocab]
    logp = torch.log_softmax(scoring, dim=-1).gather(2, targets.unsqueeze(2)).squeeze(2)
    entropy = torch.where(mask, entropy_from_logits(scoring), 0.0) if with_entropy else None
    return torch.where(mask, logp, 0.0), mask, entropy


def make_batch(same_range: bool, multiple: int = 4) -> logprobs.PaddedBatch:
    g = torch.Generator().manual_seed(0)
    # (prompt, response): SFT scores every token after the first, all rows alike; RL rows differ, one
    # has nothing to score
    shapes = [(1, 11), (1, 11), (1, 11)] if same_range else [(3, 5), (1, 10), (6, 0), (2, 3)]
    samples = [Sample(index=i, tokens=torch.randint(0, VOCAB, (p + r,), generator=g).tolist(), response_length=r)
               for i, (p, r) in enumerate(shapes)]
    return pad_samples(samples, multiple=multiple)


def compare(batch, dtype, temperature, with_entropy, chunk_size, atol, rtol, entropy_atol=None, compile_scores=None):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(*batch.tokens.shape, PADDED, generator=g) * 3
    up_logp = torch.randn(batch.tokens.shape[0], batch.max_response_length, generator=g)
    up_entropy = torch.randn(batch.tokens.shape[0], batch.max_response_length, generator=g)
    results = []
    for fn in (plain_scores, None):
        logits = base.to(dtype, copy=True).requires_grad_(True)  # fp32: a new leaf, not `base` twice
        if fn is None:
            logp, mask, entropy = score_logits(logits, batch, vocab_size=VOCAB, temperature=temperature,
                                               with_entropy=with_entropy, chunk_size=chunk_size,
                                               compile_scores=compile_scores)
        else:
            logp, mask, entropy = fn(logits, batch, temperature, with_entropy)
        loss = (logp * up_logp).sum() + ((entropy * up_entropy).sum() if with_entropy else 0)
        loss.backward()
        results.append((logp.detach(), mask, entropy.detach() if with_entropy else None, logits.grad))
    (want_logp, want_mask, want_entropy, want_grad), (logp, mask, entropy, grad) = results
    assert torch.equal(mask, want_mask)
    assert logp.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(logp, want_logp, atol=atol, rtol=rtol)
    if with_entropy:
        # H = log Z - E_p[z] here, -sum p log p there: fp32 cancellation of values ~|z| ~ 10
        torch.testing.assert_close(entropy, want_entropy, atol=entropy_atol or atol, rtol=rtol)
    else:
        assert entropy is None
    assert grad[..., VOCAB:].abs().max() == 0  # the padded vocabulary gets no gradient
    # with the entropy's gradient, p (E_p[z] - z), the same fp32 cancellation as the entropy itself
    grad_atol = (entropy_atol or atol) if with_entropy else atol
    torch.testing.assert_close(grad.float(), want_grad.float(), atol=grad_atol, rtol=rtol)
    assert want_grad.abs().max() > 0.1  # the comparison is not between two zero gradients


@pytest.mark.parametrize("same_range", [True, False], ids=["one range", "ragged rows"])
@pytest.mark.parametrize("chunk_size", [-1, 1, 4])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_fp32_equals_the_plain_formula(same_range, chunk_size, with_entropy):
    compare(make_batch(same_range), torch.float32, 0.7, with_entropy, chunk_size, atol=1e-6, rtol=1e-6,
            entropy_atol=2e-5)


@pytest.mark.parametrize("same_range", [True, False], ids=["one range", "ragged rows"])
def test_bf16_equals_the_plain_formula_within_bf16_rounding(same_range):
    # both compute in fp32 from the same bf16 logits; only the bf16 gradient's rounding differs
    compare(make_batch(same_range), torch.bfloat16, 1.3, True, 3, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunks_equal_the_plain_formula(dtype):
    """`train.compile_scores`: the chunk kernels torch.compile'd (inductor's CPU backend here, Triton on CUDA)
    give the plain formula's values and gradients, ragged rows and one range, every combination of gradients
    (log-prob only, entropy too), without a recompile per chunk shape."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    tol = dict(atol=1e-5, rtol=1e-5, entropy_atol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for same_range, chunk_size, with_entropy in [(False, 3, True), (True, 4, False), (True, -1, True)]:
        compare(make_batch(same_range), dtype, 0.7, with_entropy, chunk_size, compile_scores=True, **tol)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # forward by entropy, both by rows and chunk length 1 or more (sizes of 1 specialise): within dynamo's
    # recompile limit of 8 a function, past which it would run eagerly again
    assert 0 < graphs <= 12, graphs
    # the same calls on batches padded to other lengths (the logits' shape and strides change): no new graph
    for multiple in (8, 16):
        for same_range, chunk_size, with_entropy in [(False, 3, True), (True, 4, False), (True, -1, True)]:
            compare(make_batch(same_range, multiple), dtype, 0.7, with_entropy, chunk_size, compile_scores=True,
                    **tol)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_compiled_is_the_default_only_on_cuda():
    from slime.backends.megatron import score_kernels

    assert not score_kernels.use_compiled(None, torch.device("cpu"))
    assert score_kernels.use_compiled(True, torch.device("cpu")) and not score_kernels.use_compiled(
        False, torch.device("cuda"))
    assert score_kernels.kernels(False) == (score_kernels.chunk_forward, score_kernels.chunk_backward)


def test_unscored_positions_get_zero_gradient():
    """The gradient is allocated uninitialised and zeroed only where no chunk writes: a row with nothing to
    score, positions before and after each row's range, the padded vocabulary."""
    batch = make_batch(False)
    logits = torch.randn(*batch.tokens.shape, PADDED).requires_grad_(True)
    logp, mask, entropy = score_logits(logits, batch, vocab_size=VOCAB, with_entropy=True)
    (logp.sum() + entropy.sum()).backward()
    scored = torch.zeros(batch.tokens.shape, dtype=torch.bool)
    for row, (p, r) in enumerate(zip(batch.host_prompt_lengths, batch.host_response_lengths, strict=True)):
        scored[row, p - 1:p - 1 + r] = True
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[~scored].abs().max() == 0 and logits.grad[..., VOCAB:].abs().max() == 0
    assert (logits.grad[scored][:, :VOCAB].abs().sum(dim=-1) > 0).all()


def test_unset_chunk_size_chunks_by_elements(monkeypatch):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * VOCAB * 2)  # two positions of three rows per chunk
    assert [c[2:] for c in logprobs._chunks((0, 0, 0), (5, 5, 5), VOCAB, -1)] == [(0, 2), (2, 2), (4, 1)]
    compare(make_batch(True), torch.float32, 1.0, True, -1, atol=1e-6, rtol=1e-6, entropy_atol=2e-5)


def test_ragged_rows_are_scored_row_by_row():
    chunks = list(logprobs._chunks((2, 0, 5), (4, 9, 0), VOCAB, 3))
    assert [(c[0], c[1], c[2], c[3]) for c in chunks] == [
        (slice(0, 1), 2, 0, 3), (slice(0, 1), 2, 3, 1),
        (slice(1, 2), 0, 0, 3), (slice(1, 2), 0, 3, 3), (slice(1, 2), 0, 6, 3)]


def test_forward_only_needs_no_graph():
    batch = make_batch(False)
    logits = torch.randn(*batch.tokens.shape, PADDED)
    with torch.no_grad():
        logp, mask, entropy = score_logits(logits, batch, vocab_size=VOCAB, temperature=1.0, with_entropy=True)
    want_logp, _, want_entropy = plain_scores(logits, batch, 1.0, True)
    torch.testing.assert_close(logp, want_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_scores", [False, True], ids=["eager", "compiled"])
def test_cuda_bf16_real_vocabulary_matches_and_keeps_less(compile_scores):
    """On CUDA with Qwen2's 151,936-token vocabulary (padded to 152,064 here), bf16 logits: the same values
    and gradients as the plain formula, and a lower peak than its fp32 copies."""
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    vocab, padded, seq = 151936, 152064, 1024
    g = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, vocab, (seq - 100 * i,), generator=g).tolist(),
                      response_length=seq - 100 * i - 1 - 50 * i) for i in range(2)]
    batch = pad_samples(samples, device="cuda")
    base = (torch.randn(2, seq, padded, generator=g) * 3).to("cuda", torch.bfloat16)
    up = torch.randn(2, batch.max_response_length, generator=g).cuda()
    results = []
    for fused in (False, True):
        logits = base.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if fused:
            logp, _, entropy = score_logits(logits, batch, vocab_size=vocab, temperature=0.8, with_entropy=True,
                                            compile_scores=compile_scores)
        else:
            logp, _, entropy = plain_scores(logits, batch, 0.8, True, vocab=vocab)
        ((logp * up).sum() + (entropy * up).sum()).backward()
        torch.cuda.synchronize()
        results.append((logp.detach(), entropy.detach(), logits.grad, torch.cuda.max_memory_allocated() - start))
    (want_logp, want_entropy, want_grad, plain_peak), (logp, entropy, grad, fused_peak) = results
    torch.testing.assert_close(logp, want_logp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(grad.float(), want_grad.float(), atol=1e-2, rtol=2e-2)
    assert fused_peak < plain_peak, (fused_peak, plain_peak)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_scores", [False, True], ids=["eager", "compiled"])
def test_cuda_batching_and_scoring_never_wait_for_the_gpu(compile_scores):
    """Building a micro-batch's tensors and scoring its logits issue no GPU->host synchronisation (torch's
    sync debug mode raises on one): a wait per micro-batch drains the GPU between micro-batches. Compiled, once
    warm: the first call compiles (and may benchmark kernels, which waits), later micro-batches must not."""
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    from slime.backends.megatron.step_data import TrainArrays, build_micro_batch

    g = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, tokens=torch.randint(0, VOCAB, (20 - i,), generator=g).tolist(), response_length=8 - i,
                      rollout_log_probs=[-1.0] * (8 - i)) for i in range(3)]
    arrays = TrainArrays(advantages=[0.5, -0.5, 1.0], old_log_probs=[[-1.0] * (8 - i) for i in range(3)])
    logits = torch.randn(3, 20, PADDED, device="cuda", requires_grad=True)
    warm = build_micro_batch(samples, [0, 1, 2], arrays, pad_token_id=0, device=torch.device("cuda"))
    logp, _, entropy = score_logits(logits, warm.batch, vocab_size=VOCAB, with_entropy=True,
                                    compile_scores=compile_scores)
    (logp.sum() + entropy.sum()).backward()
    logits.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        micro = build_micro_batch(samples, [0, 1, 2], arrays, pad_token_id=0, device=torch.device("cuda"))
        logp, _, entropy = score_logits(logits, micro.batch, vocab_size=VOCAB, with_entropy=True,
                                        compile_scores=compile_scores)
        (logp.sum() + entropy.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert micro.batch.host_response_lengths == (8, 7, 6) and logits.grad is not None


def test_a_failed_compilation_names_the_option_that_turns_it_off(monkeypatch):
    """Where inductor cannot build the kernels (no compiler, a Triton error), the failure says to set
    train.compile_scores: false instead of a compiler traceback alone."""
    from torch._inductor.exc import InductorError

    from slime.backends.megatron import score_kernels
    from slime.errors import ConfigError

    def broken(*args, **kwargs):
        raise InductorError(RuntimeError("no C++ compiler"), "compile failed")

    score_kernels.compiled_kernels.cache_clear()
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    batch = make_batch(True)
    logits = torch.randn(*batch.tokens.shape, PADDED)
    try:
        with pytest.raises(ConfigError, match="compile_scores: false"):
            score_logits(logits, batch, vocab_size=VOCAB, compile_scores=True)
    finally:
        score_kernels.compiled_kernels.cache_clear()  # not the broken pair for later tests


@pytest.mark.parametrize("same_range", [True, False], ids=["one range", "ragged rows"])
def test_compiled_whole_backward_equals_the_chunked_one(monkeypatch, same_range):
    """Compiled, no padded vocabulary, chunk_size unset: one backward kernel over the whole logits (log Z = +inf
    where nothing is scored) gives the chunked kernels' gradient bit for bit, exactly 0 off the scored positions."""
    import torch._dynamo

    torch._dynamo.reset()  # fresh compiled variants: other tests' shapes must not push these past the recompile limit
    spans = []
    real = logprobs._whole_rows
    monkeypatch.setattr(logprobs, "_whole_rows", lambda *a: spans.append(1) or real(*a))
    batch = make_batch(same_range)
    g = torch.Generator().manual_seed(1)
    base = torch.randn(*batch.tokens.shape, VOCAB, generator=g) * 3  # no padded columns
    up_logp = torch.randn(batch.tokens.shape[0], batch.max_response_length, generator=g)
    up_entropy = torch.randn(batch.tokens.shape[0], batch.max_response_length, generator=g)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        for chunk_size in (-1, 4):
            for with_entropy in (True, False):
                logits = base.to(dtype, copy=True).requires_grad_(True)
                logp, mask, entropy = score_logits(logits, batch, vocab_size=VOCAB, temperature=0.7,
                                                   with_entropy=with_entropy, chunk_size=chunk_size,
                                                   compile_scores=True)
                ((logp * up_logp).sum() + ((entropy * up_entropy).sum() if with_entropy else 0)).backward()
                grads[dtype, chunk_size, with_entropy] = logits.grad
    assert len(spans) == 4  # the whole-logits backward ran for chunk_size -1 only
    positions, mask = response_positions(batch)
    scored = torch.zeros(batch.tokens.shape, dtype=torch.bool)
    for row in range(scored.shape[0]):
        scored[row, positions[row][mask[row]]] = True
    for dtype in (torch.float32, torch.bfloat16):
        for with_entropy in (True, False):
            whole, chunked = grads[dtype, -1, with_entropy], grads[dtype, 4, with_entropy]
            assert torch.equal(whole, chunked), (dtype, with_entropy)
            assert whole[~scored].abs().max() == 0 and not whole[~scored].signbit().any()
            assert whole[scored].abs().max() > 0.1
