"""One slot decode step of the built-in engine, in process: decode + sample + tokens to the host.

Times `SlotDecoder.decode_sample` (stage the inputs, one graph replay, copy tokens and log-probs back,
wait) with the sampler inside the captured graph and, in the same run, with it run eagerly after the
graph (`--disable-graph-sampler`), at the batch sizes given, for the default sampler (temperature 1)
and a top-p one. Random-weight Qwen2 of the given shape, keys/values random, every row at position 200
(length bucket 256). CUDA only.

    python bench/decode_step.py --random-qwen2 0.5b --batches 64 256
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from slime.data.random_models import QWEN2_SHAPES, save_random_qwen2
from slime.engines.builtin.slots import INPUT_ROWS, SlotDecoder


def time_steps(decoder: SlotDecoder, batch: int, top_p: float, steps: int) -> float:
    """Median milliseconds of one step, host to host (each step waits for its tokens, no overlap)."""
    generator = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, decoder.model.config.vocab_size, (batch,), generator=generator).cuda()
    times = []
    for _ in range(steps + 10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host = decoder.stage()
        host[INPUT_ROWS.index("position"), :batch] = 200
        host[INPUT_ROWS.index("top_p"), :batch] = top_p
        host[INPUT_ROWS.index("uniform"), :batch] = torch.rand(batch, dtype=torch.float64, generator=generator)
        tokens, packed = decoder.decode_sample(tokens, host, batch, truncate=top_p < 1)
        packed.cpu()
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-qwen2", default="0.5b", choices=sorted(QWEN2_SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_random_qwen2(Path(tmp) / "model", args.random_qwen2, torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    slots = max(args.batches)
    with torch.inference_mode():
        for graph_sampler in (False, True):
            decoder = SlotDecoder(model, slots=slots, max_len=1024, device=torch.device("cuda"), cuda_graphs=True,
                                  graph_sampler=graph_sampler)
            for layer in decoder.keys + decoder.values:
                layer.normal_()
            where = "in the graph" if graph_sampler else "eager after the graph"
            for batch in args.batches:
                for top_p in (1.0, 0.9):
                    ms = time_steps(decoder, batch, top_p, args.steps)
                    print(f"sampler {where:22s} batch {batch:4d} top_p {top_p}: {ms:.3f} ms per step", flush=True)
            del decoder
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
