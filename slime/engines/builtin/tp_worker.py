"""A follower rank of a tensor-parallel built-in engine: `python -m slime.engines.builtin.tp_worker` (started by
rank 0, tp_group.py; never by hand).

It loads the same checkpoint as rank 0, keeps its own slice of it (tp_shard.py), then runs every model operation
rank 0 announces, in order, on its own slot KV cache (which holds its own heads): the slot decoder's prefill, decode
step and slot moves, the `transformers` prefill and the copy of its keys/values into the slots, weight updates
(rank 0 broadcasts each full HF tensor, every rank copies its slice in), the weights checker, and the memory
release. It samples nothing: rank 0 does, from logits every rank computes (replicated lm_head).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
from transformers import DynamicCache

from slime.engines.builtin.batch import left_padded, transformers_forward
from slime.engines.builtin.engine import EngineArgs, load_model, resolve_device, resolve_dtype
from slime.engines.builtin.fusion import ProjectionFusion, weight_slots
from slime.engines.builtin.slots import SlotDecoder
from slime.engines.builtin.tp_group import TensorParallel
from slime.engines.builtin.tp_shard import install_all_reduce, shard_parameters
from slime.engines.builtin.weights import WeightChecker, WeightTargets
from slime.offload import HostParking

logger = logging.getLogger(__name__)


class Follower:
    """One follower's model, slot cache and weight targets, and the operations rank 0 announces."""

    def __init__(self, model: Any, tp: TensorParallel, args: EngineArgs) -> None:
        self.model, self.tp, self.args = model, tp, args
        self.projections = None if args.disable_fused_projections else ProjectionFusion(model)
        self.decoder: SlotDecoder | None = None
        self.cache: DynamicCache | None = None  # the last `transformers` prefill's keys/values
        self.targets = WeightTargets(model, tp)
        self.checker = WeightChecker(model, tp)
        self.parking = HostParking()

    def run(self) -> None:
        """Run announced operations until `stop`."""
        while True:
            op, args = self.tp.receive()
            if op == "stop":
                return
            with torch.inference_mode():
                getattr(self, f"op_{op}")(*args)

    # ------------------------------------------------------------------ per step (no answer: rank 0 does not wait)

    def op_slots(self, options: dict[str, Any]) -> None:
        self.decoder = SlotDecoder(self.model, device=self.tp.device, projections=self.projections, tp=self.tp,
                                   **options)

    def op_drop_slots(self) -> None:
        self.decoder = None

    def op_prefill(self, prompts: list[list[int]], first_slot: int) -> None:
        self.decoder.prefill(prompts, first_slot)

    def op_decode(self, positions: list[int]) -> None:
        self.decoder.decode(None, positions)

    def op_move(self, src: int, dst: int, length: int) -> None:
        self.decoder.move(src, dst, length)

    def op_forward(self, prompts: list[list[int]], all_positions: bool, keep: bool) -> None:
        """Rank 0's `transformers` prefill; its cache kept for the `write_prefill` that follows when `keep` (a group
        that generates), dropped when the prompts were only scored."""
        ids, mask, positions = left_padded(prompts, self.tp.device)
        cache = DynamicCache(config=self.model.config)
        transformers_forward(self.model, ids, mask, positions, cache, all_positions)
        self.cache = cache if keep else None

    def op_write_prefill(self, rows: list[int], lengths: list[int], first_slot: int) -> None:
        self.decoder.write_prefill(self.cache, rows, lengths, first_slot)
        self.cache = None

    def op_weights(self, specs: list[tuple[str, list[int], str]]) -> None:
        self.targets.receive(specs)

    # ------------------------------------------------------------------ answered (`TensorParallel.call`)

    def _answer(self, fn: Any) -> None:
        try:
            result = ("ok", fn())
        except Exception as exc:
            result = ("error", f"{type(exc).__name__}: {exc}")
        self.tp.answer(result)

    def op_ready(self) -> None:
        self._answer(lambda: os.getpid())

    def op_check(self, action: Any) -> None:
        self._answer(lambda: self.checker.run(action))

    def op_park(self) -> None:
        def park() -> int:
            self.decoder = None
            moved = self.parking.park(weight_slots(self.model, self.projections))
            if self.tp.device.type == "cuda":
                torch.cuda.empty_cache()
            return moved

        self._answer(park)

    def op_unpark(self) -> None:
        self._answer(self.parking.unpark)


def _exit_with_parent() -> None:
    """Leave when rank 0's process is gone (re-parented), even if blocked in a collective that never ends."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        logger.error("tensor-parallel follower: rank 0 (pid %d) is gone; leaving", parent)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slime.engines.builtin.tp_worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--engine-args", required=True, help="JSON of this rank's EngineArgs")
    ns = parser.parse_args(argv)
    # the whole process group of a stopped server gets these: rank 0 shuts down first and then tells us to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # `kill -USR1 <pid>` prints where every thread of this rank is (a collective that never ends, a graph capture)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level="INFO", format=f"%(asctime)s %(levelname)s tp{ns.rank} %(name)s: %(message)s")
    _exit_with_parent()
    args = EngineArgs(**json.loads(ns.engine_args))
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if args.mem_fraction_static is not None:  # rank 0 sizes the slot cache; each rank caps its own process
            torch.cuda.set_per_process_memory_fraction(args.mem_fraction_static, device)
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // ns.world_size))
    tp = TensorParallel.join(ns.rank, ns.world_size, ns.master_port, device)
    try:
        model = load_model(args.model_path, device, resolve_dtype(args.dtype, device))
        shard_parameters(model, ns.rank, ns.world_size)
        install_all_reduce(model, tp.all_reduce)
        follower = Follower(model, tp, args)
    except Exception as exc:  # told to rank 0 at its first call ("ready"), which names this rank
        logger.exception("tensor-parallel rank %d could not load the model", ns.rank)
        tp.receive()
        tp.answer(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    follower.run()
    tp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
