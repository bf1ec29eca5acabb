"""Census of the aten operations of one training micro-batch: the Megatron train step versus plain HF Qwen2.

    python bench/op_census.py                                  # 0.5B shape, 2 layers, seq 512, bf16, both models
    python bench/op_census.py --model 1.5b --layers 2 --seq 512 --top 15
    python bench/op_census.py --which megatron --megatron apply_rope_fusion=true --top 20

Device-independent costs of a step, counted on the CPU: a `TorchDispatchMode` sees every aten operation the step
runs and records, per operation that launches work (views, `detach`, allocations and ops on empty tensors do
not), one kernel and the bytes it reads and writes (the tensors' logical sizes: what a GPU kernel moves at
least). Operations are grouped by

* phase: `fwd`, `bwd` (inside autograd's backward, `torch._C._current_graph_task_id()`), `opt` (the optimizer
  step: megatron's fp32 main-param update, grad-norm, clip and the copy back to bf16; AdamW for HF), `setup`
  (before the model runs: gradient buffers zeroed) and `finalize` (after backward, before the optimizer);
* scope: `embed` (the embedding and what runs before the first layer, e.g. rotary tables), `layer` (the
  transformer layers; tables show the mean per layer), `head` (final norm and output layer), `loss` (from the
  logits to the loss: forward, and backward until the logits' gradient exists). Backward scopes are delimited
  by gradient hooks on the tensors between them (the logits, each layer's output, the first layer's input);
* category: `gemm`, `attn` (SDPA), `cast` (dtype conversions), `copy` (clone / contiguous / same-dtype copies),
  `cat` (cat, stack), `fill` (zeros, fill_), `index` (embedding, gather, scatter, index ops), `reduce`, `elem`
  (everything else: pointwise math, norms' pieces, rotary, SwiGLU), `sync` (`.item()`, `nonzero` & co.: on a GPU
  the host waits for the device there, so Python's launch overhead is no longer hidden behind queued kernels).

`cast + copy + cat + fill` are the layout bytes: work a fused kernel or a different layout would not do.

The Megatron model is built as bench/train_step.py builds it (mbridge over a random Qwen2 config, megatron DDP,
megatron's optimizer with bf16 + fp32 master weights, `slime.backends.megatron.train.train_step` with the SFT
loss, one micro-batch of one sample); the HF model as bench/torch_reference.py builds it (SDPA, AdamW, no
gradient checkpointing; HF's shifted cross entropy). On the CPU megatron's defaults differ from CUDA's: the
torch.compile'd fusions (SwiGLU, rotary) and gradient-accumulation fusion are off, so their unfused ops are
counted; pass `--megatron bias_activation_fusion=true` etc. to count the fused ones (each compiled region is
then one opaque call, not seen by the census). Foreach optimizer ops count as one kernel each (a GPU runs one
per ~chunk of tensors). Kernel counts say how many launches a step pays (at 0.5B a GPU kernel of this size
takes a few microseconds, so launches and layout bytes, not FLOPs, are what differs); bytes say what
memory-bound kernels cost (bytes / ~3 TB/s on an H100). Prints tables; `--json` prints one JSON line instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

aten = torch.ops.aten
CATEGORIES = ("gemm", "attn", "cast", "copy", "cat", "fill", "index", "reduce", "elem", "sync")
# ops whose result the host waits for on a GPU (a value read, a data-dependent shape): the CPU stops queueing work
_SYNC = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item", "is_nonzero")
LAYOUT = ("cast", "copy", "cat", "fill")
_NO_WORK = {aten.detach.default, aten.empty.memory_format, aten.empty_strided.default, aten.lift_fresh.default, aten._unsafe_view.default, aten.alias.default,
            aten.set_.source_Storage_storage_offset, aten.is_same_size.default,
            aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default, aten.resize_.default,
            aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}
_OVERWRITE = ("copy_", "fill_", "zero_", "index_put_", "_index_put_impl_", "normal_", "uniform_",
              "bernoulli_", "set_")
_GEMM = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "dot")
_CAT = ("cat", "stack")
_FILL = ("fill_", "zero_", "zeros", "ones", "full", "new_zeros", "new_ones", "new_full", "zeros_like",
         "ones_like", "full_like", "masked_fill_", "_foreach_zero_")
_INDEX = ("embedding", "embedding_dense_backward", "gather", "scatter", "scatter_add", "scatter_add_",
          "index_select", "index", "index_put_", "index_put", "_index_put_impl_", "index_add_", "masked_scatter_",
          "nll_loss_forward", "nll_loss_backward", "slice_scatter", "select_scatter", "select_backward",
          "slice_backward", "masked_select")
_REDUCE = ("sum", "mean", "amax", "max", "min", "logsumexp", "norm", "linalg_vector_norm", "_foreach_norm",
           "_log_softmax", "_log_softmax_backward_data", "_softmax", "_softmax_backward_data", "all", "any",
           "argmax", "cumsum", "var_mean", "std")


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def category(func: Any, args: tuple, out: Any) -> str:
    """The census category of one aten call (see the module docstring)."""
    name = func._schema.name.removeprefix("aten::")
    if name in _SYNC:
        return "sync"
    if name in _GEMM:
        return "gemm"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attn"
    if name in ("_to_copy", "copy_", "_foreach_copy_", "clone", "contiguous"):
        ins = _tensors(args)
        outs = _tensors(out) or ins[:1]
        return "cast" if ins and outs and ins[-1].dtype != outs[0].dtype else "copy"
    if name in _CAT:
        return "cat"
    if name in _FILL:
        return "fill"
    if name in _INDEX:
        return "index"
    if name in _REDUCE:
        return "reduce"
    return "elem"


class Census(TorchDispatchMode):
    """Counts kernels and bytes per (phase, scope, category) and per op name; `scope` is set by the caller's
    hooks, the phase from autograd (backward) or `phase`."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.scope = "-"
        self.bwd_scope = "loss"
        self.backward_seen = False
        self.totals: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.by_op: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])

    def where(self) -> tuple[str, str]:
        if torch._C._current_graph_task_id() != -1:
            self.backward_seen = True
            return "bwd", self.bwd_scope
        if self.phase == "fwd" and self.backward_seen:  # after the backward pass, before the optimizer step
            return "finalize", "-"
        return self.phase, self.scope

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func in _NO_WORK:
            return out
        schema = func._schema
        mutated, read = [], []
        for arg, value in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                              schema.arguments[len(args):]], strict=False):
            target = mutated if arg.alias_info is not None and arg.alias_info.is_write else read
            target.extend(_tensors(value))
        written = mutated if mutated else _tensors(out)
        if not any(t.numel() for t in written + read):
            return out
        # an in-place op reads what it updates (add_, the optimizer's states), one that only overwrites does not
        overwrite = (schema.name.removeprefix("aten::").removeprefix("_foreach_") in _OVERWRITE
                     or schema.overload_name.startswith("out"))
        moved = sum(_nbytes(t) for t in read) + sum(_nbytes(t) for t in written) * (1 if overwrite or not mutated else 2)
        phase, scope = self.where()
        cat = category(func, args, out)
        for table, key in ((self.totals, (phase, scope, cat)),
                           (self.by_op, (phase, scope, f"{schema.name.removeprefix('aten::')}[{cat}]"))):
            table[key][0] += 1
            table[key][1] += moved
        return out


def _first_tensor(output: Any) -> torch.Tensor | None:
    tensors = _tensors(output)
    return tensors[0] if tensors else None


def instrument(census: Census, model: torch.nn.Module, layers: list[torch.nn.Module],
               logits_module: torch.nn.Module) -> None:
    """Forward hooks that set the census scope: model start -> embed, each layer -> layer, after the last layer ->
    head, after `logits_module` -> loss; gradient hooks on the logits, each layer's output and the first layer's
    input move the backward scope the other way."""
    def set_bwd(scope: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            census.bwd_scope = scope
        return hook

    def start(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        census.phase, census.scope, census.bwd_scope = "fwd", "embed", "loss"

    model.register_forward_pre_hook(start, with_kwargs=True)
    for i, layer in enumerate(layers):
        def pre(module: torch.nn.Module, args: Any, kwargs: Any, i: int = i) -> None:
            census.scope = "layer"
            hidden = _first_tensor((args, kwargs))
            if i == 0 and hidden is not None and hidden.requires_grad:
                hidden.register_hook(set_bwd("embed"))

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            census.scope = "head"
            hidden = _first_tensor(output)
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(set_bwd("layer"))

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post)

    def logits_done(module: torch.nn.Module, args: Any, output: Any) -> None:
        census.scope = "loss"
        logits = _first_tensor(output)
        if logits is not None and logits.requires_grad:
            logits.register_hook(set_bwd("head"))

    logits_module.register_forward_hook(logits_done)


def wrap_optimizer(census: Census, optimizer: Any) -> None:
    """The optimizer's step runs in phase `opt`; what follows backward before it, in `finalize`."""
    step = optimizer.step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        census.phase, census.scope = "opt", "-"
        try:
            return step(*args, **kwargs)
        finally:
            census.phase = "done"

    optimizer.step = counted_step


def megatron_census(config: Any, seq: int, dtype: torch.dtype, megatron: dict[str, Any],
                    fp32_logits: bool = False, rope_cos_sin_cache: bool = True,
                    foreach_param_copy: bool = True) -> Census:
    """One SFT train step (one micro-batch of one sample) of the Megatron model, built as bench/train_step.py
    builds it; the step runs twice (the first allocates the optimizer state), the second is counted."""
    from mbridge.core.util import unwrap_model
    from train_step import build_megatron

    from slime.backends.megatron.train import StepSettings, train_step
    from slime.types import Sample

    # torch's fused AdamW, as on CUDA (it has a CPU kernel)
    _, models, _, optimizer = build_megatron(config, dtype, megatron, fused_adam=True,
                                             rope_cos_sin_cache=rope_cos_sin_cache,
                                             foreach_param_copy=foreach_param_copy)
    settings = StepSettings(loss_type="sft_loss", micro_batch_size=1, fp32_logits=fp32_logits)
    tokens = torch.randint(0, config.vocab_size, (seq,), generator=torch.Generator().manual_seed(0)).tolist()
    samples = [Sample(index=0, tokens=tokens, response_length=seq - 1)]
    train_step(models, optimizer, samples, settings, vocab_size=config.vocab_size)  # optimizer state exists now
    census = Census()
    gpt = unwrap_model(models)[0]
    instrument(census, gpt, list(gpt.decoder.layers), gpt)
    wrap_optimizer(census, optimizer)
    with census:
        train_step(models, optimizer, samples, settings, vocab_size=config.vocab_size)
    return census


def hf_census(config: Any, seq: int, dtype: torch.dtype) -> Census:
    """One step of bench/torch_reference.py's loop (one micro-batch of one sample), the second one counted."""
    from torch_reference import build, train_step

    torch.manual_seed(0)
    # fused AdamW, as on CUDA (torch has a CPU kernel)
    model, optimizer = build(config, torch.device("cpu"), grad_checkpointing=False, dtype=dtype, fused=True)
    tokens = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    train_step(model, optimizer, tokens, 1)
    census = Census()
    instrument(census, model.model, list(model.model.layers), model.lm_head)
    wrap_optimizer(census, optimizer)
    with census:
        train_step(model, optimizer, tokens, 1)
    return census


def summarize(census: Census, layers: int) -> dict[str, dict[str, dict[str, float]]]:
    """{row: {category: [kernels, bytes]}} with rows `phase/scope`; layer rows are per layer."""
    rows: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for (phase, scope, cat), (kernels, moved) in census.totals.items():
        row = f"{phase}/{scope}" if phase in ("fwd", "bwd") else phase
        div = layers if scope == "layer" and phase in ("fwd", "bwd") else 1
        rows[row][cat][0] += kernels / div
        rows[row][cat][1] += moved / div
    return {r: dict(c) for r, c in rows.items()}


ROW_ORDER = ("setup", "fwd/embed", "fwd/layer", "fwd/head", "fwd/loss", "bwd/loss", "bwd/head", "bwd/layer",
             "bwd/embed", "finalize", "opt")


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """Kernels and MB per row (layer rows per layer), layout bytes split by category, each model side by side."""
    names = list(results)
    header = f"{'row':<10}" + "".join(f" | {n[:8]:>8} kern {'MB':>8} {'layoutMB':>8} {'cast':>7} {'copy':>7} "
                                      f"{'cat':>7} {'fill':>7} sync" for n in names)
    print(header)
    print("-" * len(header))
    for row in ROW_ORDER:
        line = f"{row:<10}"
        for name in names:
            cats = results[name]["rows"].get(row, {})
            kern = sum(v[0] for v in cats.values())
            total = sum(v[1] for v in cats.values()) / 1e6
            layout = [cats.get(c, [0, 0])[1] / 1e6 for c in LAYOUT]
            line += (f" | {'':>8} {kern:>4.0f} {total:>8.1f} {sum(layout):>8.1f} " +
                     " ".join(f"{x:>7.1f}" for x in layout) + f" {cats.get('sync', [0, 0])[0]:>4.0f}")
        print(line)


def print_top(name: str, census: Census, layers: int, top: int) -> None:
    """The `top` ops by bytes in each of the layer rows and the rest (per layer for layer rows)."""
    print(f"\n{name}: top ops by bytes (per layer in layer rows): kernels, MB")
    groups: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    for (phase, scope, op), (kernels, moved) in census.by_op.items():
        div = layers if scope == "layer" and phase in ("fwd", "bwd") else 1
        row = f"{phase}/{scope}" if phase in ("fwd", "bwd") else phase
        groups[row].append((op, kernels / div, moved / div / 1e6))
    for row in ROW_ORDER:
        if row in groups:
            ops = sorted(groups[row], key=lambda x: -x[2])[:top]
            print(f"  {row}: " + "; ".join(f"{op} x{k:g} {mb:.1f}" for op, k, mb in ops))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_step import megatron_options

    from slime.data.random_models import QWEN2_SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(QWEN2_SHAPES), default="0.5b")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (the shape's others kept)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--which", choices=("both", "megatron", "hf"), default="both")
    parser.add_argument("--megatron", action="append", default=[], metavar="KEY=VALUE",
                        help="a megatron model option, as bench/train_step.py takes it; repeatable")
    parser.add_argument("--fp32-logits", action="store_true",
                        help="megatron: the logits upcast to fp32 before scoring (train.fp32_logits)")
    parser.add_argument("--no-rope-cos-sin-cache", dest="rope_cos_sin_cache", action="store_false",
                        help="megatron with apply_rope_fusion=true: cos/sin at every call, as before the cache")
    parser.add_argument("--no-foreach-param-copy", dest="foreach_param_copy", action="store_false",
                        help="megatron: its per-parameter fp32 -> bf16 copy after the optimizer step")
    parser.add_argument("--top", type=int, default=0, help="also list each row's N heaviest ops")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of tables")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    from transformers import Qwen2Config

    config = Qwen2Config(max_position_embeddings=max(4096, args.seq),
                         **{**QWEN2_SHAPES[args.model], "num_hidden_layers": args.layers})
    censuses = {}
    if args.which in ("both", "megatron"):
        censuses["megatron"] = megatron_census(config, args.seq, dtype, megatron_options(args.megatron),
                                              args.fp32_logits, args.rope_cos_sin_cache, args.foreach_param_copy)
    if args.which in ("both", "hf"):
        censuses["hf"] = hf_census(config, args.seq, dtype)
    results = {name: {"rows": summarize(c, args.layers)} for name, c in censuses.items()}
    if args.json:
        print(json.dumps({"model": args.model, "layers": args.layers, "seq": args.seq, "dtype": args.dtype,
                          "megatron": args.megatron, **results}))
        return
    print(f"{args.model} shape, {args.layers} layers, seq {args.seq}, {args.dtype}, one micro-batch of one sample; "
          "MB = 1e6 bytes read + written; layer rows are per layer")
    print_table(results)
    for name, census in censuses.items():
        if args.top:
            print_top(name, census, args.layers, args.top)


if __name__ == "__main__":
    main()
