"""How the built-in engine groups arriving requests, and the slot cache's batched prefill copy."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.engines.builtin.slots import SlotDecoder


@pytest.fixture(scope="module")
def engine(tiny_kit):
    eng = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), random_seed=3, kv_cache="slots"))
    yield eng
    eng.shutdown()


def _body(prompt: list[int], new_tokens: int) -> dict:
    return {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}}


async def _trickle(engine, count: int, gap_s: float, long_tokens: int = 150) -> tuple[list[dict], int]:
    """One long request starts a batch; `count` more arrive `gap_s` apart while it decodes.
    Returns the replies (long request last) and the prefill groups the arrivals took."""
    scheduler = engine.scheduler
    long = asyncio.ensure_future(engine.generate(_body([5, 6, 7], long_tokens)))
    start = scheduler.steps
    while scheduler.steps == start or scheduler._batch is None:  # the long request is decoding
        await asyncio.sleep(0.001)
    before = scheduler.prefills
    replies = []
    for i in range(count):
        replies.append(asyncio.ensure_future(engine.generate(_body([10 + i, 11, 12 + i], 4))))
        await asyncio.sleep(gap_s)
    done = await asyncio.gather(*replies, long)
    return list(done), scheduler.prefills - before


def test_requests_trickling_into_a_running_batch_are_prefilled_as_one_group(engine):
    scheduler = engine.scheduler
    window, cap = scheduler.admission_window_s, scheduler.admission_max_s
    scheduler.admission_window_s, scheduler.admission_max_s = 2.0, 30.0  # 20 ms gaps: one burst
    try:
        replies, groups = asyncio.run(_trickle(engine, count=5, gap_s=0.02, long_tokens=400))
    finally:
        scheduler.admission_window_s, scheduler.admission_max_s = window, cap
    assert groups == 1
    assert all(r["meta_info"]["completion_tokens"] == 4 for r in replies[:-1])
    assert replies[-1]["meta_info"]["completion_tokens"] == 400


def test_a_group_closes_when_arrivals_stop_fill_the_rows_or_wait_too_long(engine):
    """The close rule itself, on arrival times set by hand (the real threads' timing is not
    reproducible on a loaded machine)."""
    from slime.engines.builtin.scheduler import Scheduler

    scheduler = Scheduler.__new__(Scheduler)  # only the admission settings and the waiting list
    # wide margins: a stalled test process must not turn "just arrived" into "quiet for a while"
    scheduler.admission_window_s, scheduler.admission_max_s = 1.0, 10.0
    now = time.perf_counter()

    def waiting(*ages: float) -> list:
        return [SimpleNamespace(arrival=now - age) for age in ages]

    scheduler._waiting = waiting(2.0, 0.01)  # the last came just now: more may follow
    assert not scheduler._group_closed(room=8)
    assert scheduler._group_closed(room=2)  # no row left for more
    scheduler._waiting = waiting(2.0, 1.5)  # quiet for 1.5 s: the burst is over
    assert scheduler._group_closed(room=8)
    scheduler._waiting = waiting(*[12.0 - 0.2 * i for i in range(60)], 0.01)  # a steady stream: capped
    assert scheduler._group_closed(room=100)
    scheduler._waiting = waiting(*[5.0 - 0.2 * i for i in range(25)], 0.01)
    assert not scheduler._group_closed(room=100)


def test_trickled_requests_keep_exact_logprobs(engine):
    """Rows admitted mid-batch through the slot cache score like a fresh teacher-forced pass."""
    replies, _ = asyncio.run(_trickle(engine, count=3, gap_s=0.003, long_tokens=30))
    prompts = [[10 + i, 11, 12 + i] for i in range(3)] + [[5, 6, 7]]
    for prompt, reply in zip(prompts, replies, strict=True):
        ids = torch.tensor([prompt + reply["output_ids"]])
        with torch.no_grad():
            logits = engine.model(ids).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).gather(
            1, torch.tensor(reply["output_ids"]).unsqueeze(1)).squeeze(1)
        got = torch.tensor([lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]])
        assert (got - ref).abs().max().item() < 1e-5


def test_write_prefill_copies_each_rows_tokens_to_the_start_of_its_slot(engine):
    model = engine.model
    config = model.config
    slots = SlotDecoder(model, slots=6, max_len=32, device=torch.device("cpu"), cuda_graphs=False)
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    width, lengths = 7, [7, 3, 1, 5]
    layers = [(torch.randn(4, kv_heads, width, head_dim), torch.randn(4, kv_heads, width, head_dim))
              for _ in range(config.num_hidden_layers)]
    cache = DynamicCache(layers, config=config)
    slots.write_prefill(cache, [2, 0, 3], [lengths[2], lengths[0], lengths[3]], first_slot=1)
    for layer, (keys, values) in enumerate(layers):
        for slot, row in ((1, 2), (2, 0), (3, 3)):
            n = lengths[row]
            assert torch.equal(slots.keys[layer][slot, :, :n], keys[row, :, width - n :])
            assert torch.equal(slots.values[layer][slot, :, :n], values[row, :, width - n :])
        assert not slots.keys[layer][0].any() and not slots.keys[layer][4:].any()  # other slots untouched


def test_requests_without_rid_get_unique_sglang_style_ids(engine):
    async def go():
        return await asyncio.gather(*[engine.generate(_body([3, 4], 1)) for _ in range(20)])

    ids = [reply["meta_info"]["id"] for reply in asyncio.run(go())]
    assert len(set(ids)) == 20
    assert all(len(rid) == 32 and int(rid, 16) >= 0 for rid in ids)
    given = asyncio.run(engine.generate({**_body([3, 4], 1), "rid": "mine"}))
    assert given["meta_info"]["id"] == "mine"


def test_overlapped_decoding_gives_the_same_tokens_and_logprobs(engine, tiny_kit):
    """Slot mode launches the next decode before the host has the current tokens; commands between
    steps (weight updates) discard that decode. Seeded requests must come out exactly as without
    the overlap, with commands interleaved or not."""
    plain = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), random_seed=3, kv_cache="slots",
                                     disable_overlap_schedule=True))
    bodies = [{"input_ids": [7 + i, 8, 9 + 2 * i], "return_logprob": True,
               "sampling_params": {"max_new_tokens": 12 + 9 * i, "temperature": 0.9, "sampling_seed": 40 + i,
                                   "ignore_eos": True}} for i in range(4)]

    async def go(eng, commands: bool):
        replies = asyncio.ensure_future(asyncio.gather(*[eng.generate(b) for b in bodies]))
        discarded, ahead = 0, eng.scheduler.decodes_ahead

        def pending() -> bool:
            return eng.scheduler._batch is not None and eng.scheduler._batch.pending is not None

        while commands and not replies.done():
            discarded += await asyncio.wrap_future(eng.scheduler.run_command(pending))
        return await replies, discarded if commands else eng.scheduler.decodes_ahead - ahead

    try:
        (want, never), (got, seen), (mixed, discarded) = (
            asyncio.run(go(plain, False)), asyncio.run(go(engine, False)), asyncio.run(go(engine, True)))
    finally:
        plain.shutdown()
    assert never == 0 and seen >= 20  # the overlap happened (and only where enabled)
    assert discarded == 0  # a command runs only after the pending decode was dropped
    for a, b, c in zip(want, got, mixed, strict=True):
        assert a["output_ids"] == b["output_ids"] == c["output_ids"]
        for x, y, z in zip(*(r["meta_info"]["output_token_logprobs"] for r in (a, b, c)), strict=True):
            assert x[0] == pytest.approx(y[0], abs=1e-6) and x[0] == pytest.approx(z[0], abs=1e-6)


def test_busy_period_counts_one_burst(engine):
    """/server_info's busy_period: one burst of N requests is one period with its steps, rows and phases."""
    scheduler = engine.scheduler
    while scheduler.busy:  # an earlier test's burst has fully ended
        time.sleep(0.01)
    time.sleep(0.05)

    async def burst() -> list[dict]:
        return await asyncio.gather(*[engine.generate(_body([20 + i, 21, 22], 6)) for i in range(5)])

    steps_before = scheduler.steps
    replies = asyncio.run(burst())
    deadline = time.time() + 10
    while not scheduler.stats.snapshot()["closed"] and time.time() < deadline:  # the thread notices it is idle
        time.sleep(0.01)
    period = scheduler.stats.snapshot()
    assert all(r["meta_info"]["completion_tokens"] == 6 for r in replies)
    assert period["closed"] and period["requests"] == 5 and period["prefill_rows"] == 5
    # the prefill samples the first token; every further token is one decode step of the group's rows
    assert period["decode_rows"] == 5 * 5
    assert period["decode_steps"] == scheduler.steps - steps_before == 5 and period["mean_rows"] == 5.0
    assert period["peak_rows"] == 5 and period["steps_below_peak"] == 0
    assert 0 <= period["last_arrival_at"] <= period["all_admitted_at"] <= period["first_decode_at"] < period["idle_at"]
    assert period["decode_s"] >= period["launch_s"] + period["sample_s"] + period["record_s"] > 0
    assert period["build_s"] > 0 and period["replies"] == 0  # in process: no HTTP reply serialised


def test_no_decode_is_launched_ahead_when_every_row_reaches_its_limit(engine, monkeypatch):
    """Overlapped slot decoding launches the next step before the host has this one's tokens; when every row
    reaches max_new_tokens with this step (known beforehand), that step would be decoded for nothing. A burst
    of N-token requests costs N - 1 slot decodes (the prefill samples the first token), not N."""
    scheduler = engine.scheduler
    while scheduler.busy:
        time.sleep(0.01)
    decoder = scheduler._slots
    calls = []
    decode = decoder.decode

    def counted(tokens, positions):
        calls.append(len(positions))
        return decode(tokens, positions)

    monkeypatch.setattr(decoder, "decode", counted)
    ahead = scheduler.decodes_ahead

    async def burst(lengths: list[int]) -> list[dict]:
        return await asyncio.gather(*[engine.generate(_body([30 + i, 31, 32], n)) for i, n in enumerate(lengths)])

    replies = asyncio.run(burst([7] * 4))
    assert [r["meta_info"]["completion_tokens"] for r in replies] == [7] * 4
    assert calls == [4] * 6 and scheduler.decodes_ahead - ahead == 5  # overlapped, no decode after the last
    calls.clear()
    replies = asyncio.run(burst([3, 7]))  # one row goes on: the step ahead is still launched for both
    assert [r["meta_info"]["completion_tokens"] for r in replies] == [3, 7]
    assert calls == [2, 2, 2, 1, 1, 1]


def test_busy_stats_count_steps_below_the_peak():
    from slime.engines.builtin.stats import BusyStats

    stats = BusyStats()
    assert stats.snapshot() is None
    stats.arrived()
    for rows in (3, 8, 8, 5):  # a group joins at the second step, rows leave at the last
        stats.decoded(rows, 0.001, 0.001, 0.0, 0.001, 0.004)
    stats.idle()
    stats.replied(0.002)
    period = stats.snapshot()
    assert (period["peak_rows"], period["steps_below_peak"], period["mean_rows"]) == (8, 2, 6.0)
    assert period["replies"] == 1 and period["last_reply_at"] >= period["idle_at"]
    stats.arrived()  # after the idle spell: a new period
    assert stats.snapshot()["requests"] == 1 and stats.snapshot()["decode_steps"] == 0


def test_admission_window_flag_reaches_the_scheduler_and_refuses_a_negative_one(tiny_kit):
    from slime.engines.builtin.server import build_parser, engine_args_from
    from slime.errors import ConfigError

    args = build_parser().parse_args(["--model", str(tiny_kit.model_dir), "--admission-window-ms", "2.5",
                                      "--disable-gc-freeze"])  # this test process must not freeze its GC
    assert args.admission_window_ms == 2.5
    eng = BuiltinEngine(engine_args_from(args))
    try:
        assert eng.scheduler.admission_window_s == 0.0025 and eng.scheduler.gc_freeze is False
    finally:
        eng.shutdown()
    frozen = engine_args_from(build_parser().parse_args(["--model", str(tiny_kit.model_dir)]))
    assert frozen.gc_freeze is True  # the server process's default
    with pytest.raises(ConfigError, match="--admission-window-ms must be >= 0, got -1"):
        BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), admission_window_ms=-1))
