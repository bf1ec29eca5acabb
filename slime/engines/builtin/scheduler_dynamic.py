"""The `DynamicCachePath` part of the scheduler (`scheduler.py`)."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from slime.engines.builtin.batch import (
    Request,
    _Batch,
    _cache_tensors,
    _left_pad,
    left_padded,
    transformers_forward,
)
from slime.engines.builtin.moe import capture_routing, routing_record


class DynamicCachePath:
    """The `transformers` forward over a `DynamicCache`: the prefill of the groups the slot prefill does not take
    (in slot mode too: `_merge_slots` copies its cache into the slots), and with `kv_cache="dynamic"` the running
    rows, right-aligned in one shared cache: merged, decoded and trimmed. A MoE model's routed experts, where asked,
    are those its routers chose in these forwards. Part of `Scheduler` (scheduler.py), whose state it uses."""

    def _forward(self, requests: list[Request], ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: DynamicCache, all_positions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`transformers_forward`, and when a row asked for them (MoE models) the routed experts its own routers
        chose, [B, T, L, k] int32 on the host (`moe.capture_routing`); else None."""
        if not (self.moe_top_k and any(r.return_routed_experts for r in requests)):
            return transformers_forward(self.model, ids, mask, positions, cache, all_positions), None
        with capture_routing(self.model) as seen:
            logits = transformers_forward(self.model, ids, mask, positions, cache, all_positions)
        batch, width = ids.shape
        record = routing_record([None if s is None else s.view(batch, width, -1) for s in seen], self.moe_top_k)
        return logits, record.cpu()

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

    def _prefill_transformers(self, requests: list[Request], generate: bool) -> None:
        """Prefill the group left-padded into a fresh `DynamicCache`, scoring its prompts where asked; sample the
        first tokens and merge the group into the running rows (`_merge`), or, with `generate` off, finish it."""
        ids, mask, positions = left_padded([r.input_ids for r in requests], self.device)
        cache = DynamicCache(config=self.model.config)
        scoring = any(r.logprob_start_len >= 0 for r in requests)
        if self.tp is not None:  # the other ranks run the same forward and keep its cache for `write_prefill`
            self.tp.announce("forward", [r.input_ids for r in requests], scoring, generate)
        logits, routing = self._forward(requests, ids, mask, positions, cache, all_positions=scoring)
        width = ids.shape[1]  # left-padded: row i's prompt is its last n_i columns
        self._keep_routing(requests, routing, [slice(width - len(r.input_ids), width) for r in requests])
        if scoring:
            self._score_prompts(requests, logits, ids)
            logits = logits[:, -1, :]
        if not generate:
            for request in requests:
                self._finish(request, {"type": "length", "length": 0})
            return
        tokens = self._choose(requests, logits)
        self._merge(_Batch(requests, cache, mask, tokens))

    def _merge_dynamic(self, new: _Batch) -> None:
        """Join a prefilled group to the running rows: both caches left-padded to the wider, then stacked."""
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

    def _decode_dynamic(self, batch: _Batch) -> None:
        """One step of every running row: a mask column more, one token each fed, sampled and recorded."""
        start = time.perf_counter()
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.requests), 1)], dim=1)
        positions = (batch.mask.sum(dim=1, keepdim=True) - 1).clamp(min=0)
        logits, routing = self._forward(batch.requests, batch.next_tokens.unsqueeze(1), batch.mask, positions,
                                        batch.cache)
        self._keep_routing(batch.requests, routing)
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

    def _compact_dynamic(self, batch: _Batch, keep: list[int]) -> None:
        """Keep rows `keep` of the shared cache, less the columns that became padding in every row."""
        index = torch.tensor(keep, device=self.device)
        mask = batch.mask.index_select(0, index)
        start = int((mask.sum(dim=0) > 0).long().argmax())  # first column some row still uses
        layers = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                  for k, v in _cache_tensors(batch.cache)]
        self._batch = _Batch([batch.requests[i] for i in keep], DynamicCache(layers, config=self.model.config),
                             mask[:, start:], batch.next_tokens.index_select(0, index))
