"""The `SlotCachePath` part of the scheduler (`scheduler.py`)."""

from __future__ import annotations

import time

import torch

from slime.engines.builtin.batch import Request, _Batch, _SlotBatch
from slime.engines.builtin.slots import SlotDecoder


class SlotCachePath:
    """The running rows on the slot cache (`kv_cache="slots"`, slots.py): row i is slot i. Prompts go into the
    next free slots (by the slot decoder's own prefill, or copied from a `transformers` prefill), each step
    decodes every row (launching the next decode ahead where it may), and a finished row's slot is refilled by
    a running row from above. Part of `Scheduler` (scheduler.py), whose state it uses."""

    def _slot_decoder(self) -> SlotDecoder:
        """The slot cache, built at the first request (and again after a memory release dropped it)."""
        if self._slots is None:
            self._slots = SlotDecoder(self.model, slots=self.max_running_requests, max_len=self.context_length,
                                      device=self.device, cuda_graphs=self.cuda_graphs,
                                      projections=self.projections, fuse_kv_write=self.fuse_kv_write,
                                      tp=self.tp)
        return self._slots

    def _prefill_slots(self, requests: list[Request]) -> None:
        """The slot prefill: the group's prompts run through the slot decoder's layers into the next free
        slots, then their first tokens are sampled from the last positions' logits."""
        first = len(self._batch.requests) if self._batch else 0
        decoder = self._slot_decoder()
        lengths = [len(r.input_ids) for r in requests]
        chunks = []
        for start, end in self._prefill_chunks(lengths):
            chunks.append(decoder.prefill([r.input_ids for r in requests[start:end]], first_slot=first + start))
            # the prompts' routed experts (MoE): row i's first n_i positions (the rest is padding)
            self._keep_routing(requests[start:end], self._routing_to_host(requests[start:end], decoder.last_routing),
                               [slice(0, n) for n in lengths[start:end]])
        self._append_slots(requests, self._choose(requests, torch.cat(chunks)), lengths)

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
            routing, batch.pending_routing = batch.pending_routing, None
        else:
            logits = self._slots.decode(batch.next_tokens, batch.lengths)
            routing = self._slots.last_routing
            batch.lengths = [n + 1 for n in batch.lengths]
        launched = time.perf_counter()
        tokens, logprobs = self._sample(batch.requests, logits)
        batch.next_tokens = tokens
        # the fed tokens' routed experts (MoE), queued before the next decode replays over their buffer
        routed = self._routing_to_host(batch.requests, None if routing is None else routing.unsqueeze(1))
        fetch = self._copy_to_host(tokens, logprobs)  # before the next decode: not waited for
        sampled = time.perf_counter()
        if (self.overlap and not self._waiting and self._inbox.empty()
                and any(len(r.output_ids) + 1 < r.limit for r in batch.requests)):
            batch.pending = self._slots.decode(tokens, batch.lengths)
            batch.pending_routing = self._slots.last_routing
            batch.lengths = [n + 1 for n in batch.lengths]
            self.decodes_ahead += 1
        ahead = time.perf_counter()
        host = fetch()
        fetched = time.perf_counter()
        self._keep_routing(batch.requests, routed)
        self._record(batch.requests, *host)
        end = time.perf_counter()
        self.stats.decoded(len(batch.requests), (launched - start) + (ahead - sampled), sampled - launched,
                           fetched - ahead, end - fetched, end - start)

    def _discard_pending(self) -> None:
        """Forget the decode launched ahead: the next step feeds the same tokens at the same
        positions again (rewriting the same cache entries)."""
        batch = self._batch
        if isinstance(batch, _SlotBatch) and batch.pending is not None:
            batch.pending = batch.pending_routing = None
            batch.lengths = [n - 1 for n in batch.lengths]

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
        if batch.pending_routing is not None:
            batch.pending_routing = batch.pending_routing.index_select(0, order_index)
