"""Run in a subprocess by test_routing_replay.py: MoE routing replay (R3, R2) on the tiny Qwen3-MoE (fp32, CPU, one
rank), with a spy on megatron's routers.

    python routing_replay_run.py HF_DIR CASE...   -> one JSON line per case

Cases: "replayed" (the routers' top-k are the given ids, in the log-prob pass and the train step, with activation
recomputation as well), "r2" (record in the log-prob pass, replay in a later step after the weights moved),
"errors" (what is refused), "gap" (R3 against the built-in engine's routing; engine_gap.py), "actor=WORK_DIR" (a
train rank with --use-rollout-routing-replay; alone, in its own process: the rank initialises Megatron).
"""

import copy
import json
import sys

import torch
from megatron.core.transformer.moe.router import TopKRouter
from parity_samples import make_samples

from slime.backends.megatron import routing_replay
from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
from slime.backends.megatron.logprobs import compute_log_probs
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step
from slime.errors import ConfigError, DataFormatError

POLICY = StepSettings(loss_type="policy_loss", micro_batch_size=2)
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def random_records(samples: list, layers: int, experts: int, topk: int, seed: int = 1) -> list[torch.Tensor]:
    """k distinct random experts per fed token and layer: [len(tokens) - 1, L, k] int32 per sample."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(len(s.tokens) - 1, layers, experts, generator=generator).argsort(-1)[..., :topk].int()
            for s in samples]


class Spy:
    """Forward hooks on every TopKRouter: each call's chosen experts, as a [tokens, E] bool routing map."""

    def __init__(self, models: list) -> None:
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.handles = [module.register_forward_hook(self._hook) for chunk in models for module in chunk.modules()
                        if isinstance(module, TopKRouter)]

    def _hook(self, module, args, output) -> None:
        self.calls.setdefault(module.layer_number - 1, []).append(output[1].detach().bool().clone())

    def take(self) -> dict[int, list[torch.Tensor]]:
        calls, self.calls = self.calls, {}
        return calls


def real_maps(records: list[torch.Tensor], indices: list[int], width: int, layer: int, experts: int) -> tuple:
    """(expected [S * b, E] routing map of `records`' samples `indices` padded to `width`, mask of recorded tokens)."""
    b = len(indices)
    want = torch.zeros(width, b, experts, dtype=torch.bool)
    mask = torch.zeros(width, b, dtype=torch.bool)
    for row, i in enumerate(indices):
        n = records[i].shape[0]
        want[torch.arange(n).unsqueeze(1), row, records[i][:, layer].long()] = True
        mask[:n, row] = True
    return want.view(width * b, experts), mask.view(width * b)


def mismatches(calls: dict[int, list[torch.Tensor]], records: list[torch.Tensor], parts: list[list[int]],
               widths: list[int], experts: int, calls_per_micro_batch: int = 1) -> int:
    """Recorded tokens whose spied routing differs from `records`, over every layer and call."""
    bad = 0
    for layer, maps in calls.items():
        assert len(maps) == len(parts) * calls_per_micro_batch, (layer, len(maps))
        for m, got in enumerate(maps):
            part = m // calls_per_micro_batch
            want, mask = real_maps(records, parts[part], widths[part], layer, experts)
            bad += int((got[mask] != want[mask]).any(-1).sum())
    return bad


def widths(samples: list, parts: list[list[int]]) -> list[int]:
    return [max(len(samples[i].tokens) for i in part) for part in parts]


def replayed(hf_dir: str) -> dict:
    """The log-prob pass and the train step (without and with activation recomputation) route to the given ids."""
    out: dict = {"case": "replayed"}
    for name, megatron in (("plain", None), ("recompute", RECOMPUTE)):
        bridge = make_bridge(hf_dir, megatron=megatron, routing_replay=True)
        models = build_model(bridge, hf_dir, wrap_with_ddp=True)
        optimizer = build_optimizer(models, lr=1e-3, clip_grad=1.0)
        routers = routing_replay.require_routers(models)
        vocab = bridge.hf_config.vocab_size
        samples = make_samples(vocab)
        records = random_records(samples, routers.num_layers, routers.num_experts, routers.topk)
        spy = Spy(models)
        parts = [[0, 1], [2, 3], [4, 5]]
        natural = compute_log_probs(models, samples, vocab_size=vocab, micro_batch_size=2).log_probs
        natural_bad = mismatches(spy.take(), records, parts, widths(samples, parts), routers.num_experts)
        logp = compute_log_probs(models, samples, vocab_size=vocab, micro_batch_size=2, routed_experts=records)
        logp_bad = mismatches(spy.take(), records, parts, widths(samples, parts), routers.num_experts)
        train_step(models, optimizer, samples, POLICY, vocab_size=vocab,
                   arrays=TrainArrays(old_log_probs=logp.log_probs, routed_experts=records))
        # with recomputation each router runs again in the backward pass (REPLAY_BACKWARD pops the same ids)
        train_bad = mismatches(spy.take(), records, parts, widths(samples, parts), routers.num_experts,
                               calls_per_micro_batch=2 if megatron else 1)
        left = [(r.router_replay_action, r.target_topk_idx, len(r.replay_backward_list)) for _, r in routers.replays]
        after = compute_log_probs(models, samples, vocab_size=vocab, micro_batch_size=2).log_probs  # natural again
        after_bad = mismatches(spy.take(), records, parts, widths(samples, parts), routers.num_experts)
        gap = max(float((a - b).abs().max()) for a, b in zip(natural, logp.log_probs, strict=True))
        out[name] = {"tokens": sum(len(s.tokens) - 1 for s in samples), "natural_mismatches": natural_bad,
                     "log_prob_mismatches": logp_bad, "train_mismatches": train_bad, "after_mismatches": after_bad,
                     "cleared": all(a is None and t is None and n == 0 for a, t, n in left),
                     "replay_changes_log_probs": gap, "after_finite": all(bool(torch.isfinite(x).all()) for x in after)}
        for handle in spy.handles:
            handle.remove()
    return out


def r2(hf_dir: str) -> dict:
    """R2: the old-log-prob pass records; a step moves the weights; the next step replays the recorded experts."""
    bridge = make_bridge(hf_dir, routing_replay=True)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)
    optimizer = build_optimizer(models, lr=3e-2, clip_grad=10.0)
    routers = routing_replay.require_routers(models)
    vocab = bridge.hf_config.vocab_size
    samples = make_samples(vocab)
    spy = Spy(models)
    parts = [[i] for i in range(len(samples))]
    old = compute_log_probs(models, samples, vocab_size=vocab, record_routing=True)
    spied = spy.take()
    # the recorded experts are the ones the pass routed to
    record_bad = mismatches(spied, old.routed_experts, parts, widths(samples, parts), routers.num_experts)
    arrays = TrainArrays(old_log_probs=old.log_probs, routed_experts=old.routed_experts)
    settings = StepSettings(loss_type="policy_loss", micro_batch_size=1, use_dynamic_batch_size=True,
                            max_tokens_per_gpu=20)  # other micro-batches than the log-prob pass's
    first = train_step(models, optimizer, samples, settings, vocab_size=vocab, arrays=arrays)
    spy.take()
    natural = compute_log_probs(models, samples, vocab_size=vocab).log_probs  # moved weights, own routing
    drifted = mismatches(spy.take(), old.routed_experts, parts, widths(samples, parts), routers.num_experts)
    second = train_step(models, optimizer, samples, settings, vocab_size=vocab, arrays=arrays)
    from slime.backends.megatron.batching import micro_batches

    train_parts = micro_batches([len(s.tokens) for s in samples], micro_batch_size=1, use_dynamic_batch_size=True,
                                max_tokens_per_gpu=20)
    replay_bad = mismatches(spy.take(), old.routed_experts, train_parts, widths(samples, train_parts),
                            routers.num_experts)
    return {"case": "r2", "record_mismatches": record_bad, "drifted_without_replay": drifted,
            "second_step_mismatches": replay_bad, "train_parts": train_parts, "ppo_kl": [first["ppo_kl"],
                                                                                           second["ppo_kl"]],
            "natural_finite": all(bool(torch.isfinite(x).all()) for x in natural),
            "record_shapes": [list(r.shape) for r in old.routed_experts],
            "record_min": min(int(r.min()) for r in old.routed_experts)}


def errors(hf_dir: str, dense_dir: str) -> dict:
    """What routing replay refuses, each error's message."""
    out: dict = {"case": "errors"}

    def message(fn) -> str | None:
        try:
            fn()
        except (ConfigError, DataFormatError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    out["dense"] = message(lambda: make_bridge(dense_dir, routing_replay=True))
    out["graphs"] = message(lambda: make_bridge(hf_dir, megatron={"cuda_graph_impl": "local"}, routing_replay=True))
    bridge = make_bridge(hf_dir, routing_replay=True)
    models = build_model(bridge, hf_dir)
    routers = routing_replay.require_routers(models)
    vocab = bridge.hf_config.vocab_size
    samples = make_samples(vocab)
    records = random_records(samples, routers.num_layers, routers.num_experts, routers.topk)
    for s, r in zip(samples, records, strict=True):
        s.rollout_routed_experts = r.reshape(r.shape[0], -1).tolist()
    out["valid"] = [list(r.shape) for r in routing_replay.rollout_records(samples, routers)]
    missing = copy.deepcopy(samples)
    missing[3].rollout_routed_experts = None
    out["missing"] = message(lambda: routing_replay.rollout_records(missing, routers))
    missing[3].rollout_routed_experts = records[3][:-1].reshape(records[3].shape[0] - 1, -1).tolist()
    out["short"] = message(lambda: routing_replay.rollout_records(missing, routers))
    bad = records[3].clone()
    bad[0, 1, 0] = routers.num_experts
    missing[3].rollout_routed_experts = bad.reshape(bad.shape[0], -1).tolist()
    out["out_of_range"] = message(lambda: routing_replay.rollout_records(missing, routers))
    bad[0, 1] = 5
    missing[3].rollout_routed_experts = bad.reshape(bad.shape[0], -1).tolist()
    out["repeated"] = message(lambda: routing_replay.rollout_records(missing, routers))
    plain = build_model(make_bridge(hf_dir), hf_dir)
    out["not_built"] = message(lambda: compute_log_probs(plain, samples, vocab_size=vocab, routed_experts=records))
    out["rows"] = message(lambda: TrainArrays(routed_experts=[r[:-1] for r in records]).check(samples))
    return out


def actor(hf_dir: str, work: str) -> dict:
    """A train rank (TrainActor, without Ray) with --use-rollout-routing-replay over a shard whose samples carry
    routed experts: the old-log-prob pass and both steps replay them; a sample without them is refused."""
    from pathlib import Path

    from train_actor_cycle import free_port

    from slime.config import Config
    from slime.ray.train_actor import TrainActor
    from slime.storage import write_samples

    config = Config.model_validate({
        "run": {"store": work, "run_id": "r3"}, "checkpoint": {"hf_checkpoint": hf_dir, "no_save_optim": True},
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 3, "num_rollout": 1},
        "algorithm": {"use_rollout_routing_replay": True},
        "train": {"num_steps_per_rollout": 2, "micro_batch_size": 3, "lr": 1e-3}})
    rank = TrainActor(config.model_dump(mode="json"), 0, 1)
    rank.init(f"tcp://127.0.0.1:{free_port()}")
    routers = routing_replay.require_routers(rank.models)
    samples = make_samples(260)
    for i, s in enumerate(samples):
        s.group_index, s.reward, s.rollout_log_probs = i // 3, float(i % 2), [-5.5] * s.response_length
    records = random_records(samples, routers.num_layers, routers.num_experts, routers.topk)
    for s, r in zip(samples, records, strict=True):
        s.rollout_routed_experts = r.reshape(r.shape[0], -1).tolist()
    write_samples(str(Path(work) / "good"), samples)
    spy = Spy(rank.models)
    metrics = rank.train(0, str(Path(work) / "good"))
    calls = spy.take()  # old-log-prob pass [0..2], [3..5]; each step's one micro-batch of its three samples
    passes = [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]
    bad = mismatches(calls, records, passes, widths(samples, passes), routers.num_experts)
    samples[4].rollout_routed_experts = None
    write_samples(str(Path(work) / "bad"), samples)
    try:
        rank.train(1, str(Path(work) / "bad"))
        refused = None
    except DataFormatError as e:
        refused = str(e)
    return {"case": "actor", "replay_mismatches": bad, "calls": {k: len(v) for k, v in calls.items()},
            "ppo_kl": metrics["train/ppo_kl"], "refused": refused, "asks_engine": bool(
                __import__("slime.rollout.routing", fromlist=["x"]).wants_routed_experts(config.as_namespace()))}


def main() -> None:
    hf_dir, cases = sys.argv[1], sys.argv[2:]
    if cases[0].startswith("actor="):  # the train rank initialises Megatron itself
        print(json.dumps(actor(hf_dir, cases[0].split("=", 1)[1])), flush=True)
        return
    init_megatron(seed=0)
    for case in cases:
        if case == "replayed":
            row = replayed(hf_dir)
        elif case == "r2":
            row = r2(hf_dir)
        elif case.startswith("errors="):
            row = errors(hf_dir, case.split("=", 1)[1])
        elif case == "gap":
            from engine_gap import measure

            row = {"case": "gap", **measure(hf_dir)}
        else:
            raise SystemExit(f"unknown case {case}")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
