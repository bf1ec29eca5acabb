"""MoE routing replay in the Megatron trainer, on megatron-core's `RouterReplay`: slime's R3 and R2.

* R3, rollout routing replay (`algorithm.use_rollout_routing_replay`, arXiv 2510.11370): every MoE router of
  the old-log-prob pass and of the train steps sends each token to the top-k experts the rollout engine chose for
  it (`Sample.rollout_routed_experts`), so the trainer's log-probs are those of the policy that sampled, up to
  numerics, even where a near-tie flips the trainer's own top-k.
* R2, routing replay (`algorithm.use_routing_replay`, slime's name for GSPO's Routing Replay, arXiv 2507.18071):
  the old-log-prob pass records the experts it routed each token to, and the train steps of that rollout replay
  them, so the importance ratio compares two policies that use the same experts. With R3 the rollout's experts
  are replayed in both passes and nothing is recorded (slime turns R2 on with R3 likewise). Without an
  old-log-prob pass (one step per rollout, `can_reuse_log_probs`) R2 has nothing to replay: the step's own
  forward is that pass.

Replay fixes only the discrete expert ids: the gating weights are still the trainer's router's, its softmax at
the replayed ids (after the top-k with `norm_topk_prob`, as Qwen3-MoE; over all experts otherwise; GLM-4.5: its
sigmoid scores there, without the expert bias, renormalised and scaled), so the router keeps its gradient. Only
MoE layers have routers: a dense layer's ids in a record (-1, as engines write them) are neither checked nor used. The reference and teacher passes route as their models do (slime's "fallthrough").

How it hooks into megatron-core 0.16.1: a model built with `moe_enable_routing_replay` (`make_bridge(...,
routing_replay=True)`) gives every `TopKRouter` a `RouterReplay` (`router.router_replay`), which
`topk_routing_with_score_function` asks for the top-k. With action RECORD it computes the top-k and keeps the
indices (`recorded_topk_idx`, overwritten by each call); with REPLAY_FORWARD it takes `target_topk_idx` and gathers
the router's scores there (`scores.gather(1, ids)`); with REPLAY_BACKWARD it pops the first entry of the list
that `set_target_indices` appends to, for a router run again in the backward pass (activation recomputation).
So a train step sets each micro-batch's ids with REPLAY_FORWARD before its forward and switches to
REPLAY_BACKWARD after it: a recomputation in that micro-batch's backward (or, under pipeline parallelism,
later, in 1F1B's first-in first-out order) pops the ids of the micro-batch it belongs to. megatron's static
`RouterReplay` methods act on every instance of the process (the reference and teacher models' as well), so
this module drives the instances of the model chunks it is given, found by walking their modules, keyed by the
router's global layer number.

Token layout. A micro-batch is `[b, S]` right-padded tokens (step_data.py); megatron's embedding makes it
`[S, b, H]`, a sequence-parallel rank holds S / tp contiguous positions of it, and a router sees its
`[S_local * b]` tokens in (position, row) order: the replayed ids of a layer are an `[S_local * b, k]` int64
tensor in that order (`micro_batch_ids`). Without sequence parallelism every tensor-parallel rank routes the
whole sequence. Each rank routes its own tokens, so under expert parallelism nothing is exchanged: the ids are
global expert ids and the token dispatcher sends each token to the rank that holds its experts. A sample's
record has len(tokens) - 1 rows, the experts of the tokens fed at positions 0 .. len - 2 (the engine never
feeds the last token). Positions without a record (each sample's last token, the padding) get k distinct ids
spread over the experts, ((position * b + row) * k + j) mod E: no loss reads them (the last position's logits
predict nothing, padding follows every sample under causal attention) and no token is dropped (no capacity
factor), so their experts change no trained value, only how evenly the padding loads the experts.

A sample without a record in a replay run is an error (`DataFormatError` naming it), not a silent fall back
to the trainer's routing: a mix would hide a rollout that never asked for the experts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slime.errors import ConfigError, DataFormatError
from slime.types import Sample


@dataclass(frozen=True)
class Routers:
    """The `RouterReplay` of every MoE router in this rank's model chunks, and the shapes replay needs."""

    replays: tuple[tuple[int, Any], ...]  # (0-based global layer index, its RouterReplay), in layer order
    num_layers: int  # L of a record: the model's layers (the engine writes -1 where a layer has no router)
    num_experts: int
    topk: int
    sequence_parallel: bool

    @property
    def layers(self) -> list[int]:
        return [layer for layer, _ in self.replays]


def find_routers(models: Sequence[torch.nn.Module]) -> Routers | None:
    """The replay handles of `models` (None when they were built without `moe_enable_routing_replay`)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.utils import get_model_config

    replays = sorted(((module.layer_number - 1, module.router_replay) for chunk in models for module in chunk.modules()
                      if isinstance(module, TopKRouter) and module.router_replay is not None), key=lambda x: x[0])
    if not replays:
        return None
    config = get_model_config(models[0])
    return Routers(tuple(replays), config.num_layers, config.num_moe_experts, config.moe_router_topk,
                   bool(config.sequence_parallel))


def require_routers(models: Sequence[torch.nn.Module]) -> Routers:
    """`find_routers`, refusing a model built without routing replay (a caller passed records to replay)."""
    routers = find_routers(models)
    if routers is None:
        raise ConfigError("routing replay needs the model built with it (make_bridge(..., routing_replay=True), "
                          "which sets megatron's moe_enable_routing_replay): this model's routers have no "
                          "RouterReplay")
    return routers


def check_record(record: torch.Tensor, sample: Sample, routers: Routers, what: str) -> torch.Tensor:
    """`record` ([len(tokens) - 1, L * k] or [.., L, k] ints) as [len(tokens) - 1, L, k] int32, checked: one row per
    fed token, and k distinct expert ids of [0, E) in every layer this rank routes (a repeated id would make megatron
    sum two gating weights into one expert)."""
    L, k, E = routers.num_layers, routers.topk, routers.num_experts
    rows = len(sample.tokens) - 1
    where = f"sample index={sample.index}: {what}"
    if record.dim() not in (2, 3) or record.shape[0] != rows or record.shape[1:].numel() != L * k:
        raise DataFormatError(f"{where} has shape {tuple(record.shape)}; want one row of num_layers x topk = {L} x {k} "
                              f"expert ids for each of the {rows} fed tokens (len(tokens) - 1)")
    record = record.reshape(rows, L, k).to(torch.int32)
    used = record[:, routers.layers]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= E):
        raise DataFormatError(f"{where} holds expert id {int(used.min()) if int(used.min()) < 0 else int(used.max())} "
                              f"in a MoE layer; the model has experts 0..{E - 1}")
    if k > 1 and used.numel() and bool((used.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        raise DataFormatError(f"{where} names an expert twice for one token of a MoE layer; top-k ids are distinct")
    return record


def rollout_records(samples: Sequence[Sample], routers: Routers) -> list[torch.Tensor]:
    """R3's records: each sample's `rollout_routed_experts` as a checked [len(tokens) - 1, L, k] int32 tensor."""
    out = []
    for sample in samples:
        if sample.rollout_routed_experts is None:
            raise DataFormatError(f"sample index={sample.index}: use_rollout_routing_replay replays the experts the "
                                  "rollout engine routed each token to, and this sample has none "
                                  "(rollout_routed_experts): the rollout must ask for them (return_routed_experts, "
                                  "which generate does when use_rollout_routing_replay is set), and a custom generate "
                                  "function must keep them")
        rows = sample.rollout_routed_experts
        try:
            record = torch.tensor(rows, dtype=torch.int32) if rows else torch.zeros(0, routers.num_layers * routers.topk, dtype=torch.int32)
        except (ValueError, TypeError) as exc:  # ragged rows
            raise DataFormatError(f"sample index={sample.index}: rollout_routed_experts is not one row of expert ids "
                                  f"per token ({exc})") from None
        out.append(check_record(record, sample, routers, "rollout_routed_experts"))
    return out


def micro_batch_ids(records: Sequence[torch.Tensor], width: int, routers: Routers,
                    device: torch.device | str) -> dict[int, torch.Tensor]:
    """Layer -> the `[S_local * b, k]` int64 ids its router replays for a micro-batch of `records`' samples (in row
    order) padded to `width` tokens; see the module docstring for the order and the fill of unrecorded positions."""
    b, k, layers = len(records), routers.topk, routers.layers
    position = torch.arange(width).view(width, 1, 1)
    row = torch.arange(b).view(1, b, 1)
    fill = ((position * b + row) * k + torch.arange(k)) % routers.num_experts  # [S, b, k], k distinct per token
    ids = fill.unsqueeze(0).repeat(len(layers), 1, 1, 1)  # [layers, S, b, k]
    for r, record in enumerate(records):
        ids[:, : record.shape[0], r] = record[:, layers].transpose(0, 1).long()
    if routers.sequence_parallel:  # this rank's contiguous S / tp positions
        from megatron.core import parallel_state

        tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        if width % tp:
            raise ConfigError(f"sequence parallelism: micro-batch width {width} is not a multiple of the tensor-"
                              f"parallel size {tp} (train.data_pad_size_multiplier)")
        ids = ids[:, rank * width // tp: (rank + 1) * width // tp]
    ids = ids.to(device)
    return {layer: ids[i].reshape(-1, k) for i, layer in enumerate(layers)}


def replay_forward(routers: Routers, ids: dict[int, torch.Tensor]) -> None:
    """Before a micro-batch's forward: every router takes its layer's ids (and queues them for a recomputation)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for layer, replay in routers.replays:
        replay.set_target_indices(ids[layer])
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def forward_done(routers: Routers) -> None:
    """After a micro-batch's forward: a router run again before the next forward is a backward recomputation."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for _, replay in routers.replays:
        replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


def start_recording(routers: Routers) -> None:
    """Before a forward: every router keeps the top-k it computes."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for _, replay in routers.replays:
        replay.set_router_replay_action(RouterReplayAction.RECORD)


def recorded_records(routers: Routers, lengths: Sequence[int], width: int) -> list[torch.Tensor]:
    """After a recorded forward of a micro-batch of samples of `lengths` tokens padded to `width`: each sample's
    [len - 1, L, k] int32 record on the host (-1 in the layers this rank does not route: other pipeline stages)."""
    from megatron.core import parallel_state

    b, k = len(lengths), routers.topk
    out = torch.full((b, width, routers.num_layers, k), -1, dtype=torch.int32)
    for layer, replay in routers.replays:
        ids = replay.get_recorded_indices()
        if routers.sequence_parallel:  # each rank recorded its S / tp positions: gather the sequence
            group = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.empty_like(ids) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, ids.contiguous(), group=group)
            ids = torch.cat(parts)
        out[:, :, layer] = ids.view(width, b, k).transpose(0, 1).to("cpu", torch.int32)
    return [out[r, : n - 1].clone() for r, n in enumerate(lengths)]


def clear(routers: Routers | None) -> None:
    """After a pass: no action (the routers route as the model does) and no ids kept."""
    if routers is None:
        return
    for _, replay in routers.replays:
        replay.clear_indices()
        replay.clear_router_replay_action()


@contextmanager
def cleared_after(routers: Routers | None) -> Iterator[None]:
    """Run a pass, then `clear` the routers even when it fails (a later pass must not replay stale ids)."""
    try:
        yield
    finally:
        clear(routers)
