"""megatron-core's local CUDA graphs (`megatron: {cuda_graph_impl: local}`) for the train step.

A LoRA step at micro-batch 1 is launch-bound: ~27k kernel launches per step for a 1.5B model
(docs/lora.md). megatron-core's *local* implementation (`megatron.core.transformer.cuda_graphs`) captures
each transformer layer's forward and backward as CUDA graphs and replays them, one launch per layer and
direction. It needs no Transformer Engine: it wraps any `GraphableMegatronModule` (the local spec's
`TransformerLayer` included); TE only adds weak references to the graphs' I/O buffers (less memory) and
FP8. What it does need, and what this module provides or refuses:

* a graph-safe CUDA RNG tracker (`CudaRNGStatesTracker(use_cudagraphable_rng=True)`), else every layer's
  `CudaGraphManager` asserts "RNG tracker does not support cudagraphs!": `init_megatron` seeds one when
  the megatron options ask for graphs (`requested`);
* megatron-core's schedule: the first train step runs eagerly and records each layer's calls, and
  `forward_backward_func` captures the graphs at its end; later steps replay them. Only the shapes of
  that first step have graphs (one set per distinct micro-batch shape): a later micro-batch of another
  shape would hit megatron's assertion mid-step, so `check_shapes` refuses it before the step starts;
* nothing that changes a layer's computation from Python between replays: forward-only passes
  (log-probs, the KL reference with LoRA adapters switched off by a Python flag) therefore run eagerly
  (`eager`, megatron's `toggle_cuda_graphs`), and the colocated offload, which moves the weights and
  gradient buffers to new addresses, is refused (`option_problems`);
* the first layer's input buffer kept for its backward graph (`keep_saved_inputs`): megatron-core 0.16
  returns a training graph's copied-into input buffers to its reuse pool right after capturing the forward,
  and the next capture of that shape (the last layer's output-gradient buffer) takes it, so the backward
  replay overwrites the first layer's saved input with a gradient before that layer's backward reads it:
  layer 0's input RMSNorm weight gradient came out wrong (its gradient ~1 off, normalised, the embedding's
  0.1 off, on an H100; tests/backends/megatron/test_cuda_graphs_gpu.py);
* `cuda_graph_scope` "full_iteration" needs Megatron-LM's training loop (it captures the whole
  iteration outside megatron-core's schedules), `cuda_graph_impl=transformer_engine` TE's
  `make_graphed_callables` driven by that loop: both are refused.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from slime.config.megatron_flags import SCOPES, check_options, option_problems, requested  # noqa: F401 (this module's API)
from slime.errors import ConfigError

_CAPTURED: weakref.WeakKeyDictionary[Any, frozenset[tuple[int, ...]]] = weakref.WeakKeyDictionary()


def check_device(megatron: Mapping[str, Any]) -> None:
    """CUDA graphs need CUDA: refuse them on a CPU-only machine."""
    import torch

    if requested(megatron) and not torch.cuda.is_available():
        raise ConfigError("megatron.cuda_graph_impl=local: CUDA graphs need a CUDA device; this machine has none "
                          "(drop the option for CPU runs)")


def _chunks(models: Iterable[Any]) -> list[Any]:
    from megatron.core.utils import unwrap_model

    return [unwrap_model(m) for m in models]


def _graphed(chunk: Any) -> bool:
    """Whether an (unwrapped) model chunk was built with local CUDA graphs: its TransformerConfig says so."""
    return getattr(getattr(chunk, "config", None), "cuda_graph_impl", "none") == "local"


def enabled(models: Iterable[Any]) -> bool:
    """Whether the model chunks were built with local CUDA graphs."""
    return any(_graphed(m) for m in _chunks(models))


def _input_requires_grad(module: Any, args: Any, output: Any) -> None:
    if getattr(output, "requires_grad", True) or not output.is_floating_point():
        return
    import torch

    if torch.is_grad_enabled():
        output.requires_grad_()


def keep_saved_inputs() -> bool:
    """Keep the input buffers of graphs captured for training out of megatron's tensor reuse pool (see the
    module docstring); True when this call installed it (once per process). Forward-only captures keep
    megatron's reuse. Each kept buffer is one micro-batch's first-layer input, [tokens, rows, hidden]."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord, _CudaGraphRunner

    original = _CudaGraphRunner.create_fwd_graph
    if getattr(original, "_slime_keeps_saved_inputs", False):
        return False

    @functools.wraps(original)
    def create_fwd_graph(runner: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(runner, *args, **kwargs)
        if runner.grad_enabled:  # its backward graph reads what the forward saved, inputs included
            # (an input buffer is never in the pool before: capture took it from there or from another graph)
            inputs = {id(t) for t in runner.fwd_graph_input_surface}
            pool = _CudagraphGlobalRecord.tensor_reuse_pool.pool
            pool[:] = [t for t in pool if id(t) not in inputs]
        return out

    create_fwd_graph._slime_keeps_saved_inputs = True  # type: ignore[attr-defined]
    _CudaGraphRunner.create_fwd_graph = create_fwd_graph
    return True


def prepare(models: Iterable[Any]) -> int:
    """Keep graphed layers' saved inputs (`keep_saved_inputs`) and make the first layer's input require grad
    where the embedding is frozen (LoRA, freeze lists), returning how many embeddings got the hook. megatron's
    graph capture warms each layer up with a backward towards its inputs (`torch.autograd.grad(inputs=...)`),
    which fails on a layer with no input that requires grad; the cost is the first layer's input gradient,
    computed and dropped."""
    hooked = 0
    if any(_graphed(c) for c in _chunks(models)):
        keep_saved_inputs()
    for chunk in _chunks(models):
        embedding = getattr(chunk, "embedding", None)
        if not _graphed(chunk) or embedding is None:
            continue
        if not any(p.requires_grad for p in embedding.parameters()):
            embedding.register_forward_hook(_input_requires_grad)
            hooked += 1
    return hooked


def graphs_created() -> bool:
    """Whether megatron has captured this process's graphs (at the end of the first train step's schedule)."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    return bool(_CudagraphGlobalRecord.cudagraph_created)


def check_shapes(models: Iterable[Any], shapes: Iterable[tuple[int, ...]]) -> None:
    """Refuse micro-batch shapes (`[rows, tokens]`) that have no captured graph, before a step starts:
    megatron replays only the shapes its first (recording) step saw and would assert mid-step."""
    for chunk in _chunks(models):
        captured = _CAPTURED.get(chunk)
        if captured is None:
            continue
        new = sorted(set(shapes) - captured)
        if new:
            raise ConfigError(f"megatron.cuda_graph_impl=local: micro-batch shape {list(new[0])} [rows, tokens] has no "
                              f"CUDA graph; the graphs were captured for {sorted(map(list, captured))} in the first "
                              "train step. Keep every micro-batch one shape: a fixed train.micro_batch_size that divides "
                              "the batch and train.data_pad_size_multiplier set to the longest sample length (samples "
                              "are right-padded to its multiple), or drop cuda_graph_impl")


def note_captured(models: Iterable[Any], shapes: Iterable[tuple[int, ...]]) -> None:
    """Record the shapes of the step whose end captured the graphs (`check_shapes` compares against them)."""
    for chunk in _chunks(models):
        _CAPTURED.setdefault(chunk, frozenset(shapes))


def reset(models: Iterable[Any]) -> None:
    """Drop every captured graph and give each layer a fresh graph manager: the next train step records and
    captures again (e.g. before micro-batches of a new shape). The RNG tracker stays graph-safe."""
    from megatron.core.transformer.utils import toggle_cuda_graphs

    chunks = _chunks(models)
    for chunk in chunks:
        toggle_cuda_graphs(chunk, set_to="none", reset_cuda_graphs=True)
        toggle_cuda_graphs(chunk, set_to="local", reset_cuda_graphs=True)
        _CAPTURED.pop(chunk, None)


@contextlib.contextmanager
def eager(models: Iterable[Any]) -> Iterator[None]:
    """Run the model chunks without their graphs inside the block (forward-only passes), keeping the captured
    graphs for the next train step. A no-op for chunks built without graphs."""
    from megatron.core.transformer.utils import toggle_cuda_graphs

    chunks = [c for c in _chunks(models) if _graphed(c)]
    for chunk in chunks:
        toggle_cuda_graphs(chunk, set_to="none", reset_cuda_graphs=False)
    try:
        yield
    finally:
        for chunk in chunks:
            toggle_cuda_graphs(chunk, set_to="local", reset_cuda_graphs=False)
