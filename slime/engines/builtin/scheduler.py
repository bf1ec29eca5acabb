"""Continuous batching for the built-in engine: one model thread, requests joining between steps.

Running sequences share one batched key/value cache in which every row is right-aligned (left
padding, masked out). A step first prefills newly arrived requests (admitted in groups, see
`admission_window_s`) as their own padded batch and
merges their cache into the running one (padding whichever is shorter on the left), then decodes
one token for every running row. Finished rows are dropped from the cache, and columns that became
padding in every row are trimmed. Any `transformers` causal LM works, since only its forward pass
(with `attention_mask`, `position_ids` and a `DynamicCache`) is used.

With `kv_cache="slots"` (the default on CUDA for Qwen2, Qwen3, Qwen3-MoE, GLM-4.5 and Llama) decoding runs on a
preallocated per-request slot cache with a graph-captured step (`slots.py`); rows then never move
except when a finished row's slot is refilled by the last one. Prompts are prefilled by the slot
decoder's own layers straight into their slots (`SlotDecoder.prefill`), except where `_prefill` says.
There the next decode is launched before the host has the current step's tokens (`_decode_slots`),
so the GPU computes while the host records tokens and answers finished requests.

Control commands (weight updates, cache flush, memory release) run on the model thread between
steps, so they never race a forward pass. `pause()` stops stepping without touching running
requests (SGLang's in-place pause), `abort()` finishes requests with the tokens they have.

The class here is the scheduler's face (start/stop, `submit`, `abort`, `pause`/`resume`, `run_command`, `load`)
and its model thread (`_run`, `_step`, and where the two caches part: `_prefill`, `_merge`, `_decode`,
`_drop_finished`); its other concerns live beside it as the parts it is made of:
`scheduler_dynamic.DynamicCachePath` (the `transformers` prefill and the `DynamicCache` rows),
`scheduler_slots.SlotCachePath` (the slot cache's prefill, overlapped decode and compaction) and
`scheduler_tokens.TokenChoice` (sampling, recording and stop checks); the request and batch types and the
padded `transformers` forward in `batch.py`.
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
from typing import Any

import torch

from slime.engines.builtin.batch import Request, _Batch, _SlotBatch
from slime.engines.builtin.fusion import ProjectionFusion
from slime.engines.builtin.moe import moe_top_k
from slime.engines.builtin.sampling import BadRequestError, SamplingParams
from slime.engines.builtin.scheduler_dynamic import DynamicCachePath
from slime.engines.builtin.scheduler_slots import SlotCachePath
from slime.engines.builtin.scheduler_tokens import TokenChoice
from slime.engines.builtin.slots import SlotDecoder, slot_support
from slime.engines.builtin.stats import BusyStats
from slime.engines.builtin.tp_group import TensorParallel
from slime.errors import ConfigError

logger = logging.getLogger(__name__)


class Scheduler(DynamicCachePath, SlotCachePath, TokenChoice):
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
        tp: TensorParallel | None = None,
    ) -> None:
        self.model = model
        # tensor parallelism (tp_group.py): the model is this rank's slice; every model operation of the model
        # thread is announced to the other ranks (by the slot decoder, `_prefill_transformers`, the weight targets)
        self.tp = tp
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
        # MoE models (moe.py): the experts a token is routed to; 0 for a dense model, which refuses
        # return_routed_experts
        self.moe_top_k = moe_top_k(model)
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

    def submit(self, input_ids: list[int], params: SamplingParams, rid: str, logprob_start_len: int = -1,
               return_routed_experts: bool = False, routed_experts_start_len: int = 0) -> asyncio.Future:
        """Queue a request; the returned future (of the calling event loop) resolves to the Request."""
        if return_routed_experts and not self.moe_top_k:
            raise BadRequestError("return_routed_experts: the model has no MoE layers (no experts to report)")
        self.check_input(input_ids, params.max_new_tokens)
        loop = asyncio.get_running_loop()
        seed = params.sampling_seed if params.sampling_seed is not None else self.seed * 1_000_003 + next(self._arrivals)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_ids))
        request = Request(rid, list(input_ids), params, random.Random(seed), loop.create_future(), loop,
                          logprob_start_len=logprob_start_len, stop_ids=stop_ids,
                          limit=min(params.max_new_tokens, self.context_length - len(input_ids)),
                          return_routed_experts=return_routed_experts, routed_experts_start_len=routed_experts_start_len)
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
        if self.tp is not None:
            self.tp.announce("drop_slots")

    def _choose_kv_cache(self, kv_cache: str) -> str:
        if kv_cache not in ("auto", "slots", "dynamic"):
            raise ValueError(f"kv_cache must be auto, slots or dynamic, not {kv_cache!r}")
        reason = slot_support(self.model)
        if kv_cache == "slots" and reason is not None:
            raise ValueError(f"kv_cache=slots: slot decoding does not support {reason}")
        if self.tp is not None:  # only the slot cache's operations are mirrored on the other ranks
            why = "--kv-cache dynamic turns it off" if reason is None else f"it does not support {reason}"
            if kv_cache == "dynamic" or reason is not None:
                raise ConfigError(f"--tp-size {self.tp.world} needs the slot KV cache (--kv-cache auto or slots): {why}")
            return "slots"
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
        self._prefill_transformers(requests, generate)

    def _merge(self, new: _Batch) -> None:
        """A prefilled group joins the running rows: copied into the next free slots, or merged into the shared
        `DynamicCache`."""
        if self.kv_cache == "slots":
            self._merge_slots(new)
            return
        self._merge_dynamic(new)

    def _decode(self) -> None:
        batch = self._batch  # every row is running: finished rows were dropped after prefill and aborts
        if isinstance(batch, _SlotBatch):
            self._decode_slots(batch)
            return
        self._decode_dynamic(batch)

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
        self._compact_dynamic(batch, keep)

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
