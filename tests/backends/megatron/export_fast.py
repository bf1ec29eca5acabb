"""One rank of the export fast-path test (test_export_fast.py starts it through multirank.run_ranks).

    python export_fast.py HF_DIR tensor|pipeline [fp32|bf16]   (RANK, WORLD_SIZE, INIT_METHOD in the environment)

All ranks form one tensor-parallel group (`tensor`) or one pipeline (`pipeline`) of the world size.
Each rank exports the weights twice, through `export_hf_weights` and through mbridge's own
`export_weights` (with the vocab trim and the one-copy-per-name `export_hf_weights` applies), counting the object collectives
(`all_gather_object`, `broadcast_object_list`) each made, and prints one JSON line comparing them and
the HF checkpoint the model was loaded from, with the median seconds of each export (for information:
on CUDA the object collectives are what the fast path saves; the test asserts no timing).
"""

import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from multirank import rank_env
from safetensors.torch import load_file

from slime.backends.megatron import bridge as megatron_bridge
from slime.backends.megatron.bridge import (
    build_model,
    close_megatron,
    export_hf_weights,
    init_megatron,
    make_bridge,
)

OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list")


def count_object_collectives(counter: Counter) -> None:
    """Count every call of torch.distributed's object collectives in `counter` (mbridge calls them
    through the `torch.distributed` module, so wrapping the module's attributes sees each call)."""
    for name in OBJECT_COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counter[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)


def mbridge_export(bridge, models) -> list[tuple[str, torch.Tensor]]:
    """mbridge's `export_weights`, padded vocab rows cut as `export_hf_weights` cuts them."""
    vocab = bridge.hf_config.vocab_size
    return [(name, t[:vocab] if name in ("model.embed_tokens.weight", "lm_head.weight") and t.shape[0] > vocab else t)
            for name, t in bridge.export_weights(models)]


def same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and x.dtype == y.dtype for (_, x), (_, y) in zip(a, b, strict=True))


def median_seconds(export, repeats: int = 5) -> float:
    """Median wall seconds of `export()` drained, the device synchronised before and after."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        export()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    hf_dir, layout = sys.argv[1], sys.argv[2]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[3] if len(sys.argv) > 3 else "fp32"]
    rank, world_size, init_method = rank_env()
    parallel = {"tensor_parallel": world_size} if layout == "tensor" else {"pipeline_parallel": world_size}
    init_megatron(seed=0, rank=rank, world_size=world_size, init_method=init_method, **parallel)
    bridge = make_bridge(hf_dir, dtype)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True)  # DDP-wrapped, as the train actor holds them
    calls: Counter = Counter()
    count_object_collectives(calls)

    got = list(export_hf_weights(bridge, models))
    fast_calls = sum(calls.values())
    again = list(export_hf_weights(bridge, models))  # as the next sync: the chunks' name maps are cached
    calls.clear()
    everything = mbridge_export(bridge, models)
    seen: set[str] = set()
    want = [(name, t) for name, t in everything if not (name in seen or seen.add(name))]  # first of each name
    mbridge_calls = sum(calls.values())
    seconds = {"export_hf_weights": median_seconds(lambda: list(export_hf_weights(bridge, models))),
               "mbridge": median_seconds(lambda: mbridge_export(bridge, models))}
    hf = {name: t for f in sorted(Path(hf_dir).glob("*.safetensors")) for name, t in load_file(f).items()}
    print(json.dumps({
        "rank": rank, "local": megatron_bridge.uses_local_export(bridge),
        "names": [name for name, _ in got], "mbridge_names": [name for name, _ in want],
        "mbridge_repeated": sorted({name for name, _ in everything if sum(n == name for n, _ in everything) > 1}),
        "values_equal": same(got, want), "second_export_equal": same(again, got),
        "equal_to_checkpoint": all(torch.equal(t.cpu(), hf[name]) for name, t in got),
        "checkpoint_names": sorted(hf),
        "object_collectives": {"export_hf_weights": fast_calls, "mbridge": mbridge_calls},
        "requires_grad": sorted({name for name, t in got if t.requires_grad and t.grad_fn is not None}),
        "seconds": {k: round(v, 5) for k, v in seconds.items()}, "bytes": sum(t.nbytes for _, t in got),
    }), flush=True)


if __name__ == "__main__":
    main()
    close_megatron()
