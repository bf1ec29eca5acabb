"""The sampler's two-level inverse CDF draws exactly what a full float64 cumulative sum draws."""

import pytest
import torch

from slime.engines.builtin.sampling import inverse_cdf, sample, sample_rows


@pytest.mark.parametrize("vocab", [7, 1024, 2503, 3000, 151936])
def test_inverse_cdf_equals_full_cumulative_sum(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=generator) * 3
    logits[:, ::3] = float("-inf")  # banned tokens (top-k / top-p / min_new_tokens) have probability 0
    probs = torch.softmax(logits, dim=1)
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    cdf = probs.double().cumsum(dim=1)
    expected = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    drawn = inverse_cdf(probs, uniforms)
    assert torch.equal(drawn, expected)
    assert bool((probs.gather(1, drawn.unsqueeze(1)) > 0).all())


def test_block_size_divides_the_vocabulary_when_it_can():
    from slime.engines.builtin.sampling import _block_size

    assert _block_size(151936) == 1187 and _block_size(3000) == 1000 and _block_size(2048) == 1024
    assert _block_size(2503) == 1024 and _block_size(384) == 1024  # nothing divides: padded blocks


def test_inverse_cdf_edges_never_pick_a_zero_probability_token():
    probs = torch.zeros(3, 2503)  # prime: no block size divides it, so blocks of 1024 and padding
    probs[0, 5] = 1.0  # one possible token
    probs[1, [0, 2047]] = 0.5  # the last possible token sits at a block's end
    probs[2, [100, 2100]] = 0.5  # a trailing block with no mass, padded vocabulary
    for u in (0.0, 0.5, 1.0 - 1e-16):
        drawn = inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64))
        assert bool((probs.gather(1, drawn.unsqueeze(1)) > 0).all()), (u, drawn)
    assert inverse_cdf(probs, torch.tensor([0.9, 0.9, 0.9], dtype=torch.float64)).tolist() == [5, 2047, 2100]


def _reference_sample(logits, temperatures, top_ps, top_ks, uniforms):
    """The sampler as it was before it moved into the decode graph (commit f7b59b7), kept as the reference."""
    vocab = logits.shape[1]
    top_k_on = bool(((top_ks > 0) & (top_ks < vocab)).any())
    top_p_on = bool((top_ps < 1).any())
    any_greedy, all_greedy = bool((temperatures == 0).any()), bool((temperatures == 0).all())
    unscaled = bool((temperatures == 1).all())
    greedy = temperatures == 0
    scaled = logits if unscaled else logits / torch.where(greedy, torch.ones_like(temperatures),
                                                          temperatures).unsqueeze(1)
    k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), torch.full_like(top_ks, vocab))
    if top_k_on:
        kth = torch.topk(scaled, int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p_on:
        sorted_logits, order = torch.sort(scaled, dim=1, descending=True)
        probs = torch.softmax(sorted_logits, dim=1)
        drop_sorted = (torch.cumsum(probs, dim=1) - probs) >= top_ps.unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop & (top_ps < 1).unsqueeze(1), float("-inf"))
    logprobs = torch.log_softmax(scaled, dim=1)
    if all_greedy:
        tokens = torch.argmax(scaled, dim=1)
    else:
        tokens = inverse_cdf(logprobs.exp(), uniforms)
        if any_greedy:
            tokens = torch.where(greedy, torch.argmax(scaled, dim=1), tokens)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


_MIXES = {  # per-row choices of (temperature, top_p, top_k)
    "default": ([1.0], [1.0], [-1]),
    "temperature": ([0.6, 1.0, 1.7], [1.0], [-1]),
    "all greedy": ([0.0], [1.0], [-1]),
    "greedy rows": ([0.0, 1.0, 0.8], [1.0], [-1]),
    "top-k": ([1.0, 0.7], [1.0], [-1, 1, 3, 40]),
    "top-p": ([1.0, 0.7], [1.0, 0.95, 0.6, 0.2], [-1]),
    "everything": ([0.0, 0.5, 1.0, 1.4], [1.0, 0.9, 0.3], [-1, 1, 7, 3000]),
}


def _rows(mix: str, rows: int, vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    temperatures, top_ps, top_ks = _MIXES[mix]

    def pick(values, dtype):
        return torch.tensor(values, dtype=dtype)[torch.randint(len(values), (rows,), generator=generator)]

    logits = torch.randn(rows, vocab, generator=generator) * 4
    logits[:, 7] = float("-inf")  # a banned token (min_new_tokens)
    return (logits, pick(temperatures, torch.float32), pick(top_ps, torch.float32), pick(top_ks, torch.long),
            torch.rand(rows, dtype=torch.float64, generator=generator))


@pytest.mark.parametrize("mix", sorted(_MIXES))
@pytest.mark.parametrize("vocab", [50, 2503])
def test_sample_and_the_graph_sampler_draw_what_the_previous_sampler_drew(mix, vocab):
    """`sample` (host-decided passes) and `sample_rows` with the captured graph's fixed passes (all on;
    a full sort for top-k) give the previous sampler's tokens exactly and its log-probs, every mix."""
    for seed in range(4):
        args = _rows(mix, 33, vocab, seed)
        want_tokens, want_logprobs = _reference_sample(*args)
        candidates = [sample(*args), sample_rows(*args, top_k=vocab, top_p=True)]  # eager; the truncating graph
        if mix in ("default", "temperature", "all greedy", "greedy rows"):  # no truncation: the default graph
            candidates.append(sample_rows(*args, top_k=0, top_p=False))
        for got_tokens, got_logprobs in candidates:
            assert torch.equal(got_tokens, want_tokens), (mix, seed)
            assert torch.allclose(got_logprobs, want_logprobs, atol=1e-6, rtol=0), (mix, seed)
            assert bool(torch.isfinite(got_logprobs).all())


@pytest.mark.parametrize(("mix", "truncate"), [("greedy rows", False), ("everything", True)])
def test_the_graph_sampler_reads_bf16_logits_as_float32(mix, truncate):
    """In the graph the sampler gets the model's bf16 logits: dividing by the temperature promotes
    them to exactly the float32 values `.float()` gives (and greedy rows rank the bf16 logits)."""
    args = list(_rows(mix, 16, 300, 0))
    half = args[0].bfloat16()
    args[0] = half.float()
    want = _reference_sample(*args)
    args[0] = half
    got = sample_rows(*args, top_k=300 if truncate else 0, top_p=truncate)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("truncate", [False, True])
def test_slot_decoder_samples_its_staged_rows_like_sample(tiny_kit, truncate):
    """`SlotDecoder.decode_sample` (eager on CPU: the same function the CUDA graph captures) reads
    every row's parameters, uniform and position from the staged buffer and draws what `sample`
    draws on `decode`'s logits."""
    from transformers import AutoModelForCausalLM

    from slime.engines.builtin.slots import INPUT_ROWS, SlotDecoder

    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()
    decoder = SlotDecoder(model, slots=12, max_len=64, device=torch.device("cpu"), cuda_graphs=False)
    vocab = model.config.vocab_size
    rows = 9
    _, temperatures, top_ps, top_ks, uniforms = _rows("everything" if truncate else "greedy rows", rows, vocab, 1)
    positions = torch.randint(0, 60, (rows,), generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(3))
    host = decoder.stage()
    for name, values in zip(INPUT_ROWS, (temperatures, top_ps, top_ks, uniforms, positions), strict=True):
        host[INPUT_ROWS.index(name), :rows] = values.double()
    assert host[INPUT_ROWS.index("position"), rows:].eq(0).all()  # free rows: neutral
    with torch.inference_mode():
        logits = decoder.decode(tokens, host, rows)
        want = sample(logits, temperatures, top_ps, top_ks, uniforms)
        got_tokens, packed = decoder.decode_sample(tokens, host, rows, truncate)
    assert torch.equal(got_tokens, want[0]) and torch.equal(packed[:, 0].long(), want[0])
    assert torch.allclose(packed[:, 1].float(), want[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("why", ["no truncating graph", "--disable-graph-sampler"])
def test_slot_decoder_samples_eagerly_when_the_truncating_graph_is_missing(tiny_kit, monkeypatch, why):
    """The guard for a top-k/top-p sampler that could not be captured, and --disable-graph-sampler:
    `decode_sample` then samples the default graph's logits eagerly, with the same draws."""
    from transformers import AutoModelForCausalLM

    from slime.engines.builtin import slots as slots_module

    model = AutoModelForCausalLM.from_pretrained(tiny_kit.model_dir, dtype=torch.float32).eval()
    decoder = slots_module.SlotDecoder(model, slots=8, max_len=32, device=torch.device("cpu"), cuda_graphs=False)
    rows, vocab = 5, model.config.vocab_size
    _, temperatures, top_ps, top_ks, uniforms = _rows("everything", rows, vocab, 4)
    tokens = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(5))
    host = decoder.stage()
    for name, values in zip(slots_module.INPUT_ROWS, (temperatures, top_ps, top_ks, uniforms, torch.arange(rows)),
                            strict=True):
        host[slots_module.INPUT_ROWS.index(name), :rows] = values.double()
    with torch.inference_mode():
        want_tokens, want_packed = decoder.decode_sample(tokens, host, rows, truncate=True)
        launch = decoder._launch

        def no_truncating_graph(tokens, host, batch, truncate):
            if truncate:
                raise slots_module._NoTruncatingGraph
            return launch(tokens, host, batch, truncate)

        if why == "no truncating graph":
            monkeypatch.setattr(decoder, "_launch", no_truncating_graph)
        else:
            decoder.graph_sampler = False
            step = decoder._decode_and_sample
            outputs = []
            monkeypatch.setattr(decoder, "_decode_and_sample", lambda *args: outputs.append(step(*args)) or outputs[-1])
        got_tokens, got_packed = decoder.decode_sample(tokens, host, rows, truncate=True)
    assert torch.equal(got_tokens, want_tokens)
    assert torch.allclose(got_packed, want_packed, atol=1e-6, rtol=0)
    if why != "no truncating graph":
        assert [len(out) for out in outputs] == [1]  # the step only decoded: logits, no tokens
