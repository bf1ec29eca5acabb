"""The `TokenChoice` part of the scheduler (`scheduler.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slime.engines.builtin.batch import Request
from slime.engines.builtin.sampling import sample


class TokenChoice:
    """Each running row's next token: sampled on the device, copied to the host, recorded, and checked for a
    stop. Both KV-cache paths use it. Part of `Scheduler` (scheduler.py), whose state it uses."""

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

    def _routing_to_host(self, requests: list[Request], routing: torch.Tensor | None) -> torch.Tensor | None:
        """Start copying a forward's routed experts (int32 [B, T, L, k]) to the host when a row asked for them;
        None when none did (or the model has no MoE layers). On CUDA the copy is queued without a wait: it is
        complete once the next `_copy_to_host`'s wait returns (that event is recorded after it, on the same
        stream), which every caller reaches before the records are read."""
        if routing is None or not any(r.return_routed_experts for r in requests):
            return None
        if self.device.type != "cuda":
            return routing
        return routing.to("cpu", non_blocking=True)

    def _keep_routing(self, requests: list[Request], routing: torch.Tensor | None,
                      columns: list[slice] | None = None) -> None:
        """Append to each asking row's record the routed experts of the tokens it fed: `routing` [B, T, L, k] on
        the host (`_routing_to_host`), row i's tokens at columns `columns[i]` (all T when None)."""
        if routing is None:
            return
        for row, request in enumerate(requests):
            if request.return_routed_experts:
                request.routed_experts.append(routing[row] if columns is None else routing[row, columns[row]])

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
