"""The arithmetic behind docs/scaling.md: per layout (8, 64, 512 GPUs x 7B, 32B, 235B-A22B), the memory per
train rank, the weight-sync time, the shard and checkpoint volume the store must carry, from the measured
figures of docs/benchmarks.md (the constants below, each named after its row there). Nothing is run.

    python bench/scaling.py            # prints the Markdown tables of docs/scaling.md

Memory per train rank counts the training state only: bf16 parameters (2 B), fp32 gradients (4 B) and,
sharded over the data-parallel replicas of each parameter by the distributed optimizer, fp32 master
weights and Adam's two moments (12 B). Activations come on top (see docs/scaling.md).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
# docs/benchmarks.md, "Weight sync, Megatron trainer to built-in engine", GPU table
TENSOR_GBPS = 69.8  # tensor (colocated, same GPU), 1.5B bf16, H100
TENSOR_GBPS_LOW = 28.5  # same, 0.5B (fixed costs weigh more)
NCCL_GBPS = 26.2  # distributed (NCCL cuda:0 -> cuda:1), 0.5B bf16, 2x H200 of one host
SLIME_GBPS = 8.6  # slime's reference: 30B bf16 colocated in 7.0 s
EXPORT_FAST_GBPS = 0.988 / 0.0062  # export phase of the tensor 0.5B row (one pipeline stage: fast path)
EXPORT_PER_TENSOR_S = 0.17 / 511 * 3  # mbridge export_weights with PP > 1: 3 object collectives per tensor
# docs/benchmarks.md, "Shard store": 100,000 samples x 768 tokens -> 582 MB Arrow IPC
SHARD_BYTES_PER_TOKEN = 582e6 / (100_000 * 768)
SHARD_WRITE_MBPS = 42.5  # one writer (the rollout manager), CPU-bound, 2.5 GHz Xeon core
SHARD_READ_MBPS = 1251.0  # verified Arrow read from the page cache
# docs/benchmarks.md, "Megatron train step": Qwen2 1.5B, 4096 x 8, one H200 (H100 peak): 31.1% MFU by 6N
MFU = 0.311
PEAK_FLOPS = 989e12


@dataclass(frozen=True)
class Model:
    name: str
    params: float  # all parameters
    active: float  # per token (MoE: the routed experts' share)
    expert: float  # of `params`, in routed experts (0: dense)
    tensors: int  # HF tensors in the export


MODELS = {
    # Qwen2.5-7B: 28 layers, hidden 3584; Qwen2.5-32B: 64 layers, hidden 5120; Qwen3-235B-A22B: 94 layers,
    # 128 experts of 3 x 4096 x 1536 (227.1B), 8 routed per token
    "7B": Model("7B", 7.62e9, 7.62e9, 0.0, 28 * 12 + 3),
    "32B": Model("32B", 32.8e9, 32.8e9, 0.0, 64 * 12 + 3),
    "235B-A22B": Model("235B-A22B", 235.1e9, 22.2e9, 227.1e9, 94 * (128 * 3 + 11) + 3),
}


@dataclass(frozen=True)
class Layout:
    gpus: int
    model: str
    mode: str  # colocate | decoupled
    train_gpus: int
    tp: int
    pp: int
    ep: int
    engine_gpus: int
    engine_tp: int  # GPUs per engine
    sync: str  # tensor | distributed
    prompts: int  # rollout_batch_size (x 8 samples each)
    tokens: int = 4096  # per sample: 1024 prompt + 3072 response on average
    gpu_gb: int = 80  # H100; 141 for H200

    @property
    def dp(self) -> int:
        return self.train_gpus // (self.tp * self.pp)


LAYOUTS = [
    Layout(8, "7B", "colocate", 8, 2, 1, 1, 8, 1, "tensor", 64),
    Layout(8, "32B", "colocate", 8, 8, 1, 1, 8, 4, "tensor", 32, gpu_gb=141),
    Layout(64, "7B", "decoupled", 32, 2, 1, 1, 32, 1, "distributed", 256),
    Layout(64, "32B", "decoupled", 32, 8, 1, 1, 32, 4, "distributed", 128),
    Layout(64, "235B-A22B", "colocate", 64, 4, 4, 16, 64, 8, "distributed", 128, gpu_gb=141),
    Layout(512, "7B", "decoupled", 128, 2, 1, 1, 384, 1, "distributed", 1024),
    Layout(512, "32B", "decoupled", 256, 8, 1, 1, 256, 4, "distributed", 512),
    Layout(512, "235B-A22B", "decoupled", 256, 4, 4, 16, 256, 8, "distributed", 512),
]


def state_gb_per_rank(layout: Layout) -> float:
    """Training state on one train rank (see the module docstring)."""
    m = MODELS[layout.model]
    dense = (m.params - m.expert) / (layout.tp * layout.pp)
    expert = m.expert / (layout.ep * layout.pp)  # expert tensor parallel 1
    expert_dp = max(1, layout.dp * layout.tp // layout.ep)
    return (dense * (6 + 12 / layout.dp) + expert * (6 + 12 / expert_dp)) / GB


def engine_weights_gb_per_gpu(layout: Layout) -> float:
    """bf16 weights each engine GPU holds (weights split evenly over an engine's GPUs)."""
    return 2 * MODELS[layout.model].params / layout.engine_tp / GB


def sync_seconds(layout: Layout) -> tuple[float, float, float]:
    """(export s, transfer s at the measured rate, transfer s at slime's reference rate)."""
    m = MODELS[layout.model]
    size = 2 * m.params / GB
    export = m.tensors * EXPORT_PER_TENSOR_S if layout.pp > 1 else size / EXPORT_FAST_GBPS
    rate = TENSOR_GBPS if layout.sync == "tensor" else NCCL_GBPS
    return export, size / rate, size / SLIME_GBPS


def train_seconds(layout: Layout) -> float:
    """One step's training compute at the measured MFU: 6N per token for the update plus 2N for the
    recomputed old log-probs (N: active parameters)."""
    tokens = layout.prompts * 8 * layout.tokens
    return tokens * 8 * MODELS[layout.model].active / (layout.train_gpus * MFU * PEAK_FLOPS)


def shard_mb(layout: Layout) -> float:
    return layout.prompts * 8 * layout.tokens * SHARD_BYTES_PER_TOKEN / 1e6


# --- four GPUs: what fits (docs/scaling.md, "What fits on four H100s") -------------------------------------------

GIB = 2**30
USABLE_GIB = 78.0  # what torch can allocate of an H100 80 GB (the CUDA context and NCCL buffers take the rest)


@dataclass(frozen=True)
class Shape:
    """A dense Qwen2.5 shape (untied embeddings, q/k/v biases, SwiGLU MLP, GQA)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 152064

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * self.intermediate + 2 * h
        return self.layers * layer + 2 * self.vocab * h + h

    def activation_bytes_per_token_layer(self) -> int:
        """bf16 tensors one layer keeps for its backward, per token, without recompute (flash attention: no s x s
        scores): attention 2 x (norm in, norm out, q/k/v out, attention out) = 2 (5h + 2 kv d); MLP 2 x (norm in,
        norm out) + gate and up out (4 I) + their product (2 I) = 4h + 6I."""
        return 14 * self.hidden + 4 * self.kv_heads * self.head_dim + 6 * self.intermediate

    def kv_bytes_per_token(self) -> int:
        """An engine's bf16 KV cache per token: keys and values of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


SHAPES = {  # Qwen2.5's published configs
    "7B": Shape("7B", 3584, 28, 28, 4, 18944),
    "14B": Shape("14B", 5120, 48, 40, 8, 13824),
    "32B": Shape("32B", 5120, 64, 40, 8, 27648),
    "72B": Shape("72B", 8192, 80, 64, 8, 29568),
}


def train_gib(shape: Shape, tp: int, pp: int, dp: int, tokens: int = 4096, recompute: bool = True,
              lora: bool = False) -> dict[str, float]:
    """One train rank's peak, in GiB, by part: bf16 weights (2 B / parameter), fp32 gradients (4 B, Megatron's
    grad buffer, grad_reduce_in_fp32), fp32 master weights + Adam's two moments (12 B) sharded over DP by the
    distributed optimizer; LoRA: the base frozen (no gradient or optimizer state; the adapters' are below 1%, left
    out). Activations of a micro-batch of `tokens` with sequence parallelism (every tensor / TP): all layers of
    this stage without recompute; with full recompute (uniform, one layer per checkpoint) each layer's input
    (2h B a token) plus one layer's set. The logits of the last stage: bf16 plus their fp32 gradient (6 B) over
    vocab / TP. No reference model (use_kl_loss false; with LoRA the reference is the base, adapters off)."""
    n = shape.params / (tp * pp)
    layers = shape.layers / pp
    per_layer = tokens * shape.activation_bytes_per_token_layer() / tp
    # full recompute keeps each layer's input and one layer's set; without it every layer's set
    activations = layers * tokens * 2 * shape.hidden / tp + per_layer if recompute else layers * per_layer
    parts = {"weights": 2 * n, "gradients": 0.0 if lora else 4 * n, "optimizer": 0.0 if lora else 12 * n / dp,
             "activations": activations, "logits": tokens * shape.vocab / tp * 6}
    return {k: v / GIB for k, v in parts.items()}


def engine_gib(shape: Shape, engine_tp: int, requests: int, context: int) -> dict[str, float]:
    """One engine GPU, colocated, with the trainer offloaded: bf16 weights and the KV cache of `requests` x
    `context` tokens (slot cache: allocated whole), both split over the engine's `engine_tp` GPUs."""
    return {"weights": 2 * shape.params / engine_tp / GIB,
            "kv cache": requests * context * shape.kv_bytes_per_token() / engine_tp / GIB}


# (TP, PP, DP) of four train ranks, in order of preference: the most data parallelism (the least model-parallel
# communication) first. DP 4 without TP is left out: 7B's state alone is 64 GiB a rank there, no headroom.
FOUR_GPU_LAYOUTS = [(2, 1, 2), (4, 1, 1), (2, 2, 1), (1, 4, 1)]
HEADROOM = 0.85  # of USABLE_GIB a layout is picked at: the allocator's fragmentation and what the formulas leave out


def four_gpu_fit(shape: Shape, lora: bool = False, recompute: bool = True) -> tuple[tuple[int, int, int], float]:
    """The first four-GPU train layout of FOUR_GPU_LAYOUTS whose peak per rank is within HEADROOM x USABLE_GIB
    (heads and KV heads divisible by TP, layers by PP), else the one with the lowest peak; and that peak in GiB."""
    peaks = {}
    for tp, pp, dp in FOUR_GPU_LAYOUTS:
        if shape.heads % tp or shape.kv_heads % tp or shape.layers % pp:
            continue
        peaks[(tp, pp, dp)] = sum(train_gib(shape, tp, pp, dp, recompute=recompute, lora=lora).values())
    for layout, peak in peaks.items():
        if peak <= HEADROOM * USABLE_GIB:
            return layout, peak
    layout = min(peaks, key=peaks.__getitem__)
    return layout, peaks[layout]


def four_gpu_engines(shape: Shape, samples: int = 256, context: int = 2048) -> tuple[int, float]:
    """The smallest engine TP (1, 2 or 4 GPUs an engine, KV heads divisible) at which one engine GPU holds its
    weights and the KV cache of its share of a step's `samples` running at once (`context` tokens each) within
    HEADROOM x USABLE_GIB, else TP 4; and that GPU's GiB."""
    for engine_tp in (1, 2, 4):
        if shape.kv_heads % engine_tp:
            continue
        gib = sum(engine_gib(shape, engine_tp, samples * engine_tp // 4, context).values())
        if gib <= HEADROOM * USABLE_GIB or engine_tp == 4:
            return engine_tp, gib
    raise AssertionError("unreachable: engine TP 4 is always returned")


def four_gpu_table() -> list[str]:
    rows = ["| model | params | RL | train layout (TP x PP x DP) | train rank peak | of which state | "
            "engines (256 x 2048 tokens a step) | fits 4 x 80 GB |",
            "|---|---:|---|---|---:|---:|---|---|"]
    for shape in SHAPES.values():
        engine_tp, engine = four_gpu_engines(shape)
        for lora in (False, True):
            (tp, pp, dp), peak = four_gpu_fit(shape, lora)
            parts = train_gib(shape, tp, pp, dp, lora=lora)
            state = parts["weights"] + parts["gradients"] + parts["optimizer"]
            fits = "yes" if max(peak, engine) <= USABLE_GIB else "no"
            rows.append(f"| {shape.name} | {shape.params / 1e9:.2f}B | {'LoRA' if lora else 'full'} | "
                        f"{tp} x {pp} x {dp} | {peak:.1f} GiB | {state:.1f} GiB | {4 // engine_tp} x TP {engine_tp}: "
                        f"{engine:.1f} GiB a GPU | {fits} |")
    return rows


def main() -> None:
    print("| GPUs | model | placement | train: TP x PP x EP, DP | engines | state per rank | engine weights "
          "per GPU |")
    print("|---|---|---|---|---|---:|---:|")
    for lay in LAYOUTS:
        engines = f"{lay.engine_gpus // lay.engine_tp} x {lay.engine_tp} GPU"
        print(f"| {lay.gpus} | {lay.model} | {lay.mode}: {lay.train_gpus} train + {lay.engine_gpus} engine GPUs "
              f"| {lay.tp} x {lay.pp} x {lay.ep}, DP {lay.dp} | {engines} | {state_gb_per_rank(lay):.0f} GB "
              f"(of {lay.gpu_gb}) | {engine_weights_gb_per_gpu(lay):.0f} GB |")
    print()
    print("| GPUs | model | sync | bytes | export | transfer (measured rate) | transfer (slime's 8.6 GB/s) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for lay in LAYOUTS:
        export, measured, slime = sync_seconds(lay)
        print(f"| {lay.gpus} | {lay.model} | {lay.sync} | {2 * MODELS[lay.model].params / GB:.0f} GB | "
              f"{export:.1f} s | {measured:.1f} s | {slime:.1f} s |")
    print()
    print("| GPUs | model | samples x tokens | shard set | write (1 writer) | read, all train ranks | train s "
          "(compute) | read rate for <= 5% of it | checkpoint (full state) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for lay in LAYOUTS:
        mb = shard_mb(lay)
        train = train_seconds(lay)
        ranks = lay.train_gpus
        print(f"| {lay.gpus} | {lay.model} | {lay.prompts * 8} x {lay.tokens} | {mb:.0f} MB | "
              f"{mb / SHARD_WRITE_MBPS:.1f} s | {mb * ranks / 1e3:.1f} GB | {train:.0f} s | "
              f"{mb * ranks / (0.05 * train) / 1e3:.1f} GB/s | {14 * MODELS[lay.model].params / GB:.0f} GB |")
    print()
    print("\n".join(four_gpu_table()))


if __name__ == "__main__":
    main()
