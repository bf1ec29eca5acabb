"""Every random generator a training process draws from, captured as JSON and restored exactly.

Resume is bit-exact only if the next random draw after loading equals the one an uninterrupted run
makes: Python's `random`, numpy's global generator, torch's CPU generator, each CUDA device's
generator (when CUDA is present) and megatron's CUDA RNG tracker (model-parallel dropout streams; with
CUDA graphs its graph-safe form, whose streams are generators: the same bytes are saved, set in place).
Each rank has its own states, so a checkpoint holds one small JSON file per rank. JSON instead of a
pickle: byte states are base64, the Mersenne-Twister states plain integer lists.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

RNG_FORMAT = 1


def capture_rng_state() -> dict[str, Any]:
    """The current state of every generator of this process, JSON-serialisable."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, mt_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": {"version": version, "state": list(mt_state), "gauss_next": gauss},
        "numpy": {"kind": np_kind, "keys": np_keys.tolist(), "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "cached_gaussian": float(np_gauss)},
        "torch_cpu": _encode(torch.get_rng_state()),
        "cuda": [_encode(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "megatron_tracker": {name: _encode(s.get_state() if isinstance(s, torch.Generator) else s)
                             for name, s in get_cuda_rng_tracker().get_states().items()},
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every generator to `state` (from `capture_rng_state` of the same rank)."""
    if state.get("format") != RNG_FORMAT:
        raise ValueError(f"RNG state format {state.get('format')!r} is not {RNG_FORMAT}")
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(_decode(state["torch_cpu"]))
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            raise ValueError(f"RNG state has {len(state['cuda'])} CUDA generators, this process sees "
                             f"{torch.cuda.device_count()} devices")
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])
    set_tracker_states({name: _decode(s) for name, s in state["megatron_tracker"].items()})


def set_tracker_states(states: dict[str, torch.Tensor]) -> None:
    """Set megatron's CUDA RNG tracker streams to `states` (name -> generator state bytes); also the form
    Megatron-LM checkpoints hold (`rng_state[...]["rng_tracker_states"]`, megatron_lm.py)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    if getattr(tracker, "use_cudagraphable_rng", False):
        # the graph-safe tracker (CUDA graphs) holds generators that captured graphs registered: set their
        # state in place, never swap them for tensors
        generators = tracker.get_states()
        missing = sorted(set(states) - set(generators))
        if missing:
            raise ValueError(f"RNG state names tracker streams {missing} this process's tracker does not have")
        for name, value in states.items():
            generators[name].set_state(value)
    else:
        tracker.set_states(states)


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
