"""Continuous batching for the built-in engine: one model thread, requests joining between steps.

Running sequences share one batched key/value cache in which every row is right-aligned (left
padding, masked out). A step first prefills newly arrived requests (admitted in groups, see
`admission_window_s`) as their own padded batch and
merges their cache into the running one (padding whichever is shorter on the left), then decodes
one token for every running row. Finished rows are dropped from the cache, and columns that became
padding in every row are trimmed. Any `transformers` causal LM works, since only its forward pass
(with `attention_mask`, `position_ids` and a `DynamicCache`) is used.

With `kv_cache="slots"` (the default on CUDA for Qwen2, Qwen3 and Llama) decoding runs on a
preallocated per-request slot cache with a graph-captured step (`slots.py`); rows then never move
except when a finished row's slot is refilled by the last one. Prompts are prefilled by the slot
decoder's own layers straight into their slots (`SlotDecoder.prefill`), except where `_prefill` says.
There the next decode is launched before the host has the current step's tokens (`_decode_slots`),
so the GPU computes while the host records tokens and answers finished requests.

Control commands (weight updates, cache flush, memory release) run on the model thread between
steps, so they never race a forward pass. `pause()` stops stepping without touching running
requests (SGLang's in-place pause), `abort()` finishes requests with the tokens they have.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from slime.engines.builtin.fusion import ProjectionFusion
from slime.engines.builtin.sampling import BadRequestError, SamplingParams, sample
from slime.engines.builtin.slots import SlotDecoder, slot_support
from slime.engines.builtin.stats import BusyStats

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """One generation request and its progress."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    rng: random.Random  # this request's own random stream: its samples do not depend on the batch
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    logprob_start_len: int = -1  # >= 0: also score the prompt from this position (SGLang's field)
    input_logprobs: list[float | None] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    matched_stop: str | None = None
    abort_requested: bool = False
    # set by `submit`: a token in `stop_ids` or reaching `limit` tokens may end the request (the
    # per-token fast check of `_choose`; `_check_stop` decides)
    stop_ids: frozenset[int] = frozenset()
    limit: int = 0


@dataclass
class _Batch:
    """Running rows: their requests, the shared cache and the validity mask of its columns."""

    requests: list[Request]
    cache: DynamicCache
    mask: torch.Tensor  # [B, T] long: 1 where the cache column holds a real token of that row
    next_tokens: torch.Tensor  # [B] the token each row feeds at the next decode step


@dataclass
class _SlotBatch:
    """Running rows in slot mode: row i is slot i and holds `lengths[i]` tokens."""

    requests: list[Request]
    next_tokens: torch.Tensor  # [B]
    lengths: list[int]
    # logits [B, V] of the decode already launched with `next_tokens` (whose positions `lengths`
    # already counts), or None: see `Scheduler._decode_slots`
    pending: torch.Tensor | None = None


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width == 0:
        return t
    shape = list(t.shape)
    shape[dim] = width
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and position ids [B, width] of `prompts` left-padded (with 0) to the longest,
    built on the host and copied to `device`: the `transformers` prefill's inputs."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)


def transformers_forward(model: Any, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                         cache: DynamicCache, all_positions: bool = False) -> torch.Tensor:
    """The `transformers` model's fp32 logits [B, V] of the last position, or [B, T, V] of every position when
    asked, its keys/values appended to `cache`."""
    # without padding the mask says nothing: leaving it out lets attention skip building one
    mask = None if bool(mask.all()) else mask
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=0 if all_positions else 1)
    return out.logits.float() if all_positions else out.logits[:, -1, :].float()


class Scheduler:
    """Owns the model; `submit` from any thread or event loop, results arrive on the caller's loop."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: torch.device,
        seed: int = 0,
        max_running_requests: int = 256,
        context_length: int | None = None,
        admission_window_s: float = 0.01,
        admission_max_s: float = 0.2,
        kv_cache: str = "auto",
        cuda_graphs: bool = True,
        max_slot_len: int = 4096,
        overlap: bool = True,
        fuse_projections: bool = True,
        gc_freeze: bool = False,
        compile_sampler: bool = True,
        slot_prefill: bool = True,
        fuse_kv_write: bool = True,
        chunked_prefill_size: int = 32768,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.seed = seed
        self.max_running_requests = max_running_requests
        # Arrivals are admitted in groups: a group closes once no request has come for
        # `admission_window_s` (the burst is over), once it fills the free rows, or once its first
        # request has waited `admission_max_s`. Concurrent requests are then prefilled together (no
        # left padding between them for their whole life), and requests trickling in over HTTP do
        # not each cost an eager prefill forward between two decode steps (measured on an H100: 256
        # HTTP requests ran at 40% of the in-process rate when every step admitted what had come).
        self.admission_window_s = admission_window_s
        self.admission_max_s = admission_max_s
        self.context_length = context_length or getattr(model.config, "max_position_embeddings", 1 << 30)
        self.kv_cache = self._choose_kv_cache(kv_cache)
        if self.kv_cache == "slots":  # every request must fit its slot
            self.context_length = min(self.context_length, max_slot_len)
        self.cuda_graphs = cuda_graphs
        # on CUDA the sampler's common path (no top-k / top-p / greedy row) runs as one compiled
        # function (sampling.compiled_draw): ~15 eager kernels over [B, V] were ~0.7 ms of a 2.9 ms
        # step at 256 rows on an H200; on CPU it stays eager, as the slot decoder's fused parts
        self.compile_sampler = compile_sampler and device.type == "cuda"
        self.overlap = overlap  # slot mode: launch the next decode before this step's tokens reach the host
        # slot mode: prompts prefilled by the slot decoder's own layer body, straight into their slots
        # (`SlotDecoder.prefill`) instead of the `transformers` forward + DynamicCache + `write_prefill`
        self.slot_prefill = slot_prefill and self.kv_cache == "slots"
        # its activations grow with rows x longest prompt (a 7B MLP holds ~76 KB a token): a group is
        # prefilled in row chunks of at most this many padded tokens (SGLang's --chunked-prefill-size)
        self.chunked_prefill_size = chunked_prefill_size
        # slot mode, CUDA graphs: the decode step's rotary + K/V cache writes as one compiled function
        # (`slots.rotate_write_kv_fn`); on CPU eager, as the slot decoder's other compiled pieces
        self.fuse_kv_write = (fuse_kv_write and self.kv_cache == "slots" and cuda_graphs
                              and device.type == "cuda")
        self._slots: SlotDecoder | None = None
        # slot mode: q/k/v and gate/up weights made views into one buffer each, once (fusion.py); the
        # memory release parks those buffers (`fusion.weight_slots`)
        self.projections = ProjectionFusion(model) if self.kv_cache == "slots" and fuse_projections else None
        if self.projections is not None and device.type == "cuda":
            with torch.cuda.device(device):  # the members' old storage, freed layer by layer
                torch.cuda.empty_cache()
        self.eos_ids = self._eos_ids()
        self.weight_version = "default"
        self._arrivals = itertools.count()
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._waiting: list[Request] = []
        self._admitting: list[Request] = []  # taken from _waiting by the prefill running now
        self._batch: _Batch | _SlotBatch | None = None
        self._wake = threading.Event()
        self._paused = False
        self._released = False
        self._stopping = False
        self._abort_all = False
        self._abort_rids: set[str] = set()
        self._lock = threading.Lock()
        self._finished: list[Request] = []  # resolved on their event loops once per step, not one by one
        self._thread = threading.Thread(target=self._run, name="builtin-engine", daemon=True)
        self.steps = 0
        self.prefills = 0  # prefill forwards run (admission groups), reported by /server_info
        self.decodes_ahead = 0  # slot decodes launched before the previous step's tokens were on the host
        self.generated_tokens = 0
        self.stats = BusyStats()  # where the current burst's time goes (/server_info's busy_period)
        # Freeze the garbage collector's view of what exists at start and after the first burst (the
        # model, slot cache, compiled kernels and graphs: ~400k objects). A full collection walked them
        # all, 0.3 s with the GIL held, at random moments in a burst of requests (server processes only:
        # frozen cyclic garbage is never freed)
        self.gc_freeze = gc_freeze
        self._frozen_after_work = False

    # ------------------------------------------------------------------ public API (any thread)

    def start(self) -> None:
        if self.gc_freeze:
            gc.collect()
            gc.freeze()
        self.stats.watch_gc()
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.stats.unwatch_gc()

    def check_input(self, input_ids: list[int], max_new_tokens: int = 0) -> None:
        """Raise BadRequestError for input this engine cannot run (before anything is queued).

        Like SGLang 0.5.23, prompt + max_new_tokens may not exceed the context length.
        """
        if not input_ids:
            raise BadRequestError("input is empty: give at least one token")
        total = len(input_ids) + max_new_tokens
        if total > self.context_length or len(input_ids) >= self.context_length:
            raise BadRequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                f"tokens. You requested a total of {total} tokens: {len(input_ids)} tokens from the input "
                f"and {max_new_tokens} tokens for the completion.")
        if self._released:
            raise BadRequestError("engine memory is released; call /resume_memory_occupation first")
        vocab = self.model.config.vocab_size
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(f"input_ids holds {bad[:5]} outside the vocabulary [0, {vocab})")

    def submit(self, input_ids: list[int], params: SamplingParams, rid: str, logprob_start_len: int = -1) -> asyncio.Future:
        """Queue a request; the returned future (of the calling event loop) resolves to the Request."""
        self.check_input(input_ids, params.max_new_tokens)
        loop = asyncio.get_running_loop()
        seed = params.sampling_seed if params.sampling_seed is not None else self.seed * 1_000_003 + next(self._arrivals)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_ids))
        request = Request(rid, list(input_ids), params, random.Random(seed), loop.create_future(), loop,
                          logprob_start_len=logprob_start_len, stop_ids=stop_ids,
                          limit=min(params.max_new_tokens, self.context_length - len(input_ids)))
        self.stats.arrived()
        self._inbox.put(request)
        self._wake.set()
        return request.done

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        with self._lock:
            if abort_all:
                self._abort_all = True
            elif rid is not None:
                self._abort_rids.add(rid)
        self._wake.set()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    @property
    def alive(self) -> bool:
        """The model thread is running."""
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    def run_command(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the model thread between two steps (also while paused)."""
        future: Future = Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future

    def load(self) -> dict[str, int]:
        batch = self._batch
        running = len(batch.requests) if batch else 0
        if batch is None:
            tokens = 0
        elif isinstance(batch, _SlotBatch):
            tokens = sum(batch.lengths)
        else:
            tokens = int(batch.mask.sum())
        return {"num_reqs": running + len(self._waiting) + self._inbox.qsize(),
                "num_waiting_reqs": len(self._waiting) + self._inbox.qsize(), "num_tokens": tokens}

    def set_released(self, released: bool) -> None:
        self._released = released

    def drop_kv_cache(self) -> None:
        """Free the slot cache and its captured graphs (model thread only: use `run_command`); they
        are rebuilt at the next request. Needed when the weights move (memory release)."""
        self._slots = None

    def _choose_kv_cache(self, kv_cache: str) -> str:
        if kv_cache not in ("auto", "slots", "dynamic"):
            raise ValueError(f"kv_cache must be auto, slots or dynamic, not {kv_cache!r}")
        reason = slot_support(self.model)
        if kv_cache == "slots" and reason is not None:
            raise ValueError(f"kv_cache=slots: slot decoding does not support {reason}")
        if kv_cache == "auto":
            return "slots" if self.device.type == "cuda" and reason is None else "dynamic"
        return kv_cache

    @property
    def busy(self) -> bool:
        return bool(self._batch or self._waiting or not self._inbox.empty())

    # ------------------------------------------------------------------ model thread

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if value is not None:
                ids |= set(value) if isinstance(value, list | tuple) else {value}
        return ids

    def _run(self) -> None:
        if self.device.type == "cuda":  # per thread; new threads start on cuda:0 (events, graph capture streams)
            torch.cuda.set_device(self.device)
        while not self._stopping:
            self._run_commands()
            while True:
                try:
                    self._waiting.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            self._apply_aborts()
            if self._batch is None and self._waiting and not self._paused:
                self._collect_burst()
            if self._paused or not (self._waiting or self._batch):
                self._publish()
                if not self._paused:
                    self.stats.idle()
                if self.gc_freeze and not self._frozen_after_work and self.steps:
                    self._frozen_after_work = True
                    gc.collect()
                    gc.freeze()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as exc:  # a failed step fails its requests, the engine keeps serving
                logger.exception("engine step failed")
                failed = (self._batch.requests if self._batch else []) + self._admitting + self._waiting
                self._batch, self._admitting, self._waiting = None, [], []
                for request in {id(r): r for r in failed}.values():  # an admitted row may be merged already
                    self._fail(request, exc)
            self._publish()

    def _collect_burst(self) -> None:
        """Idle engine: block (GIL released, so the HTTP thread runs freely) until the group closes."""
        first = min(r.arrival for r in self._waiting)
        while len(self._waiting) < self.max_running_requests:
            last = self._waiting[-1].arrival  # the inbox is in arrival order
            remaining = min(last + self.admission_window_s, first + self.admission_max_s) - time.perf_counter()
            if remaining <= 0:
                return
            try:
                self._waiting.append(self._inbox.get(timeout=remaining))
            except queue.Empty:
                return

    def _group_closed(self, room: int) -> bool:
        """Running engine: admit the waiting requests now, or keep decoding while more arrive?"""
        if len(self._waiting) >= room:
            return True
        now = time.perf_counter()
        return (now - self._waiting[-1].arrival >= self.admission_window_s
                or now - self._waiting[0].arrival >= self.admission_max_s)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            self._discard_pending()  # e.g. new weights: the next token must come from them
            try:
                with torch.inference_mode():
                    future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _apply_aborts(self) -> None:
        with self._lock:
            abort_all, rids = self._abort_all, self._abort_rids
            self._abort_all, self._abort_rids = False, set()
        if not (abort_all or rids):
            return
        for request in self._waiting + (self._batch.requests if self._batch else []):
            if abort_all or request.rid in rids:
                request.abort_requested = True
        for request in [r for r in self._waiting if r.abort_requested]:
            self._waiting.remove(request)
            self._finish(request, {"type": "abort", "message": "Aborted"})
        self._drop_finished()

    def _step(self) -> None:
        room = self.max_running_requests - (len(self._batch.requests) if self._batch else 0)
        batch = self._batch
        ahead = isinstance(batch, _SlotBatch) and batch.pending is not None  # its new rows would lack logits
        if room > 0 and self._waiting and (batch is None or (not ahead and self._group_closed(room))):
            self.prefills += 1
            started = time.perf_counter()
            admitted, self._waiting = self._waiting[:room], self._waiting[room:]
            self._admitting = admitted  # neither waiting nor running until merged: a failure must fail them too
            scoring = [r for r in admitted if r.params.max_new_tokens == 0]
            if scoring:  # prompt scoring only (e.g. teacher log-probs): no token is generated
                self._prefill(scoring, generate=False)
            admitted = [r for r in admitted if r.params.max_new_tokens > 0]
            if admitted:
                self._prefill(admitted)
                self._drop_finished()  # rows that stopped at their first token
            self._admitting = []
            self.stats.prefilled(len(admitted), time.perf_counter() - started,
                                 len(self._waiting) + self._inbox.qsize())
        if self._batch is not None:
            self._decode()
        self._drop_finished()
        self.steps += 1

    def _score_prompts(self, requests: list[Request], logits: torch.Tensor, ids: torch.Tensor) -> None:
        """SGLang's input_token_logprobs: log p(token_i | tokens_<i) for i >= logprob_start_len,
        None for the first token of the sequence (nothing predicts it)."""
        logprobs = torch.log_softmax(logits[:, :-1, :], dim=-1).gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
        width = ids.shape[1]
        for row, request in enumerate(requests):
            if request.logprob_start_len < 0:
                continue
            n = len(request.input_ids)
            values = [None] + logprobs[row, width - n : width - 1].tolist()
            request.input_logprobs = values[request.logprob_start_len :]

    def _prefill(self, requests: list[Request], generate: bool = True) -> None:
        """Prefill an admitted group and sample its first tokens (or only score its prompts). The slot
        prefill (`_prefill_slots`) takes groups that generate and score no prompt token; the `transformers`
        forward takes the rest: prompt scoring (logprob_start_len >= 0 needs every position's logits, and a
        group holding one such request goes this way whole), scoring-only groups, the dynamic KV cache, and
        `--disable-slot-prefill`. A loaded LoRA adapter is merged into the weights (lora.py), so both paths
        apply it."""
        if generate and self.slot_prefill and all(r.logprob_start_len < 0 for r in requests):
            self._prefill_slots(requests)
            return
        ids, mask, positions = left_padded([r.input_ids for r in requests], self.device)
        cache = DynamicCache(config=self.model.config)
        scoring = any(r.logprob_start_len >= 0 for r in requests)
        logits = transformers_forward(self.model, ids, mask, positions, cache, all_positions=scoring)
        if scoring:
            self._score_prompts(requests, logits, ids)
            logits = logits[:, -1, :]
        if not generate:
            for request in requests:
                self._finish(request, {"type": "length", "length": 0})
            return
        tokens = self._choose(requests, logits)
        self._merge(_Batch(requests, cache, mask, tokens))

    def _decode(self) -> None:
        batch = self._batch  # every row is running: finished rows were dropped after prefill and aborts
        if isinstance(batch, _SlotBatch):
            self._decode_slots(batch)
            return
        start = time.perf_counter()
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.requests), 1)], dim=1)
        positions = (batch.mask.sum(dim=1, keepdim=True) - 1).clamp(min=0)
        logits = transformers_forward(self.model, batch.next_tokens.unsqueeze(1), batch.mask, positions,
                                      batch.cache)
        launched = time.perf_counter()
        tokens, logprobs = self._sample(batch.requests, logits)
        sampled = time.perf_counter()
        host = self._copy_to_host(tokens, logprobs)()
        fetched = time.perf_counter()
        self._record(batch.requests, *host)
        batch.next_tokens = tokens
        end = time.perf_counter()
        self.stats.decoded(len(batch.requests), launched - start, sampled - launched, fetched - sampled,
                           end - fetched, end - start)

    def _decode_slots(self, batch: _SlotBatch) -> None:
        """One slot-cache step, overlapped with the host: the sampled tokens stay on the device and
        feed the next decode, launched before this step's tokens reach the host; its logits wait in
        `batch.pending` while the host records this step (stop checks, replies), so the GPU is not
        idle during that bookkeeping. Rows that finish now were decoded once more for nothing; their
        pending rows are dropped with them (`_compact_slots`). Nothing is launched ahead while
        requests wait to join (their rows would lack pending logits), nor when every row reaches its
        token limit with this step (known on the host: a burst of equal-length requests, as an RL
        rollout's, would otherwise end on one whole decode step for nothing)."""
        start = time.perf_counter()
        if batch.pending is not None:
            logits, batch.pending = batch.pending, None
        else:
            logits = self._slots.decode(batch.next_tokens, batch.lengths)
            batch.lengths = [n + 1 for n in batch.lengths]
        launched = time.perf_counter()
        tokens, logprobs = self._sample(batch.requests, logits)
        batch.next_tokens = tokens
        fetch = self._copy_to_host(tokens, logprobs)  # before the next decode: not waited for
        sampled = time.perf_counter()
        if (self.overlap and not self._waiting and self._inbox.empty()
                and any(len(r.output_ids) + 1 < r.limit for r in batch.requests)):
            batch.pending = self._slots.decode(tokens, batch.lengths)
            batch.lengths = [n + 1 for n in batch.lengths]
            self.decodes_ahead += 1
        ahead = time.perf_counter()
        host = fetch()
        fetched = time.perf_counter()
        self._record(batch.requests, *host)
        end = time.perf_counter()
        self.stats.decoded(len(batch.requests), (launched - start) + (ahead - sampled), sampled - launched,
                           fetched - ahead, end - fetched, end - start)

    def _discard_pending(self) -> None:
        """Forget the decode launched ahead: the next step feeds the same tokens at the same
        positions again (rewriting the same cache entries)."""
        batch = self._batch
        if isinstance(batch, _SlotBatch) and batch.pending is not None:
            batch.pending = None
            batch.lengths = [n - 1 for n in batch.lengths]

    def _choose(self, requests: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Sample the next token of every row that is still running and record it."""
        tokens, logprobs = self._sample(requests, logits)
        self._record(requests, *self._copy_to_host(tokens, logprobs)())
        return tokens

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch the sampler: tokens and their log-probs, on the logits' device (no host sync)."""
        for row, request in enumerate(requests):
            if len(request.output_ids) < request.params.min_new_tokens:
                banned = list(request.params.stop_token_ids) + ([] if request.params.ignore_eos else list(self.eos_ids))
                if banned:
                    logits[row, banned] = float("-inf")
        p = [r.params for r in requests]
        tokens, logprobs = sample(  # parameters built on the host: `sample` moves them without a sync
            logits,
            torch.tensor([x.temperature for x in p], dtype=torch.float32),
            torch.tensor([x.top_p for x in p], dtype=torch.float32),
            torch.tensor([x.top_k for x in p], dtype=torch.long),
            torch.tensor([r.rng.random() for r in requests], dtype=torch.float64),
            compiled=self.compile_sampler,
        )
        return tokens, logprobs

    def _record(self, requests: list[Request], token_list: list[int], logprob_list: list[float]) -> None:
        """Append each running row's token and log-prob (host lists) and check whether it stops."""
        for request, token, logprob in zip(requests, token_list, logprob_list, strict=True):
            if request.finish_reason is None:
                output = request.output_ids
                output.append(token)
                request.output_logprobs.append(logprob)
                self.generated_tokens += 1
                # one set lookup per token at 256 rows; the full check only when it may stop
                if token in request.stop_ids or request.params.stop or len(output) >= request.limit:
                    self._check_stop(request)

    def _copy_to_host(self, *tensors: torch.Tensor) -> Callable[[], list[list[Any]]]:
        """Start copying step results to the host; the returned function waits for them. On CUDA
        the wait happens in `Event.synchronize`, which releases the GIL, so the HTTP thread accepts
        and answers requests while the GPU computes (a plain `.tolist()` would hold the GIL for the
        whole step); work launched after this call is not waited for."""
        if self.device.type != "cuda":
            lists = [t.tolist() for t in tensors]
            return lambda: lists
        host = [t.to("cpu", non_blocking=True) for t in tensors]
        done = torch.cuda.Event()
        done.record()

        def wait() -> list[list[Any]]:
            done.synchronize()
            return [t.tolist() for t in host]

        return wait

    def _check_stop(self, request: Request) -> None:
        params, token = request.params, request.output_ids[-1]
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            request.finish_reason = {"type": "stop", "matched": token}
        elif params.stop:
            text = self.tokenizer.decode(request.output_ids[-64:], skip_special_tokens=False)
            for stop in params.stop:
                if stop in text:
                    request.finish_reason = {"type": "stop", "matched": stop}
                    request.matched_stop = stop
                    break
        if request.finish_reason is None and (
            len(request.output_ids) >= params.max_new_tokens
            or len(request.input_ids) + len(request.output_ids) >= self.context_length
        ):
            request.finish_reason = {"type": "length", "length": len(request.output_ids)}

    def _merge(self, new: _Batch) -> None:
        if self.kv_cache == "slots":
            self._merge_slots(new)
            return
        if self._batch is None:
            self._batch = new
            return
        old = self._batch
        width = max(old.mask.shape[1], new.mask.shape[1])
        pad_old, pad_new = width - old.mask.shape[1], width - new.mask.shape[1]
        layers = []
        for (ko, vo), (kn, vn) in zip(_cache_tensors(old.cache), _cache_tensors(new.cache), strict=True):
            layers.append((torch.cat([_left_pad(ko, pad_old, 2), _left_pad(kn, pad_new, 2)]),
                           torch.cat([_left_pad(vo, pad_old, 2), _left_pad(vn, pad_new, 2)])))
        self._batch = _Batch(
            old.requests + new.requests,
            DynamicCache(layers, config=self.model.config),
            torch.cat([_left_pad(old.mask, pad_old, 1), _left_pad(new.mask, pad_new, 1)]),
            torch.cat([old.next_tokens, new.next_tokens]),
        )

    def _slot_decoder(self) -> SlotDecoder:
        """The slot cache, built at the first request (and again after a memory release dropped it)."""
        if self._slots is None:
            self._slots = SlotDecoder(self.model, slots=self.max_running_requests, max_len=self.context_length,
                                      device=self.device, cuda_graphs=self.cuda_graphs,
                                      projections=self.projections, fuse_kv_write=self.fuse_kv_write)
        return self._slots

    def _prefill_slots(self, requests: list[Request]) -> None:
        """The slot prefill: the group's prompts run through the slot decoder's layers into the next free
        slots, then their first tokens are sampled from the last positions' logits."""
        first = len(self._batch.requests) if self._batch else 0
        decoder = self._slot_decoder()
        lengths = [len(r.input_ids) for r in requests]
        logits = torch.cat([decoder.prefill([r.input_ids for r in requests[start:end]], first_slot=first + start)
                            for start, end in self._prefill_chunks(lengths)])
        self._append_slots(requests, self._choose(requests, logits), lengths)

    def _prefill_chunks(self, lengths: list[int]) -> list[tuple[int, int]]:
        """[start, end) row ranges, in order, each at most `chunked_prefill_size` padded tokens (its rows x its
        longest prompt; a single row over it is a chunk of its own); one range when the limit is -1."""
        limit = self.chunked_prefill_size
        if limit < 0:
            return [(0, len(lengths))]
        chunks, start, width = [], 0, 0
        for row, n in enumerate(lengths):
            if row > start and (row - start + 1) * max(width, n) > limit:
                chunks.append((start, row))
                start, width = row, 0
            width = max(width, n)
        chunks.append((start, len(lengths)))
        return chunks

    def _merge_slots(self, new: _Batch) -> None:
        """Copy the prefilled rows' keys/values into the next free slots."""
        first = len(self._batch.requests) if self._batch else 0
        lengths = [int(n) for n in new.mask.sum(dim=1).tolist()]
        self._slot_decoder().write_prefill(new.cache, list(range(len(lengths))), lengths, first_slot=first)
        self._append_slots(new.requests, new.next_tokens, lengths)

    def _append_slots(self, requests: list[Request], tokens: torch.Tensor, lengths: list[int]) -> None:
        """Rows whose prompts fill the slots after the running ones join the batch; the first sampled
        token is fed next, at position `length` of its slot."""
        old = self._batch or _SlotBatch([], tokens[:0], [])
        self._batch = _SlotBatch(old.requests + requests, torch.cat([old.next_tokens, tokens]), old.lengths + lengths)

    def _drop_finished(self) -> None:
        batch = self._batch
        if batch is None:
            return
        for request in batch.requests:
            if request.abort_requested and request.finish_reason is None:
                request.finish_reason = {"type": "abort", "message": "Aborted"}
        keep = [i for i, r in enumerate(batch.requests) if r.finish_reason is None]
        for request in batch.requests:
            if request.finish_reason is not None:
                self._finish(request, request.finish_reason)
        if not keep:
            self._batch = None
            return
        if len(keep) == len(batch.requests):
            return
        if isinstance(batch, _SlotBatch):
            self._compact_slots(batch, keep)
            return
        index = torch.tensor(keep, device=self.device)
        mask = batch.mask.index_select(0, index)
        start = int((mask.sum(dim=0) > 0).long().argmax())  # first column some row still uses
        layers = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                  for k, v in _cache_tensors(batch.cache)]
        self._batch = _Batch([batch.requests[i] for i in keep], DynamicCache(layers, config=self.model.config),
                             mask[:, start:], batch.next_tokens.index_select(0, index))

    def _compact_slots(self, batch: _SlotBatch, keep: list[int]) -> None:
        """Keep rows `keep` in slots 0 .. len(keep)-1: each hole below that is filled by a running row
        from above it (one slot copy per hole, no shifting)."""
        size = len(keep)
        holes = [i for i in range(size) if batch.requests[i].finish_reason is not None]
        movers = [i for i in keep if i >= size]
        order = list(range(len(batch.requests)))
        for hole, mover in zip(holes, movers, strict=True):
            self._slots.move(mover, hole, batch.lengths[mover])
            order[hole] = mover
        order = order[:size]
        batch.requests = [batch.requests[i] for i in order]
        batch.lengths = [batch.lengths[i] for i in order]
        order_index = torch.tensor(order, device=self.device)
        batch.next_tokens = batch.next_tokens.index_select(0, order_index)
        if batch.pending is not None:
            batch.pending = batch.pending.index_select(0, order_index)

    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
        request.finish_reason = reason
        self._finished.append(request)

    def _publish(self) -> None:
        """Hand the requests finished since the last call to their event loops: one wake-up per loop
        and step, however many requests finished in it."""
        if not self._finished:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[Request]] = {}
        for request in self._finished:
            by_loop.setdefault(request.loop, []).append(request)
        self._finished = []
        for loop, requests in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve_all, requests)

    def _fail(self, request: Request, exc: Exception) -> None:
        request.loop.call_soon_threadsafe(_reject, request.done, exc)


def _resolve_all(requests: list[Request]) -> None:
    for request in requests:
        if not request.done.done():
            request.done.set_result(request)


def _reject(future: asyncio.Future, exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
