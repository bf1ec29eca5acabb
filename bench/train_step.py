"""Throughput and MFU of the Megatron train step (slime.backends.megatron.train_step) on random Qwen2 models.

    python bench/train_step.py --model 0.5b --seq 1024 --global-batch 16 --micro-batch 4
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1 --lora-rank 64
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1 --loss grpo
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1 --loss grpo --reuse-log-probs
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1 --no-fused-adam
    python bench/train_step.py --model 0.5b --seq 4096 --global-batch 8 --micro-batch 1 --fp32-logits
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1 --megatron gradient_accumulation_fusion=false
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1 --megatron apply_rope_fusion=false
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 2 --megatron recompute_granularity=selective
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1 --lora-rank 64 --megatron cuda_graph_impl=local
    python bench/train_step.py --model 1.5b --seq 4096 --global-batch 8 --micro-batch 1 --ab rope-cos-sin-cache --steps 7

Builds a random-weight Qwen2 of the named size through mbridge (bf16 params, fp32 master weights and
gradients, Adam), then times train steps after warm-up steps. `--loss sft` (the default): full SFT
steps, every token but the first a loss token. `--loss grpo`: the train side of a GRPO iteration as the
train actor pays it (slime/ray/train_actor.py): the old policy's log-probs recomputed by the policy
(`compute_log_probs`, forward only), the reference log-probs by a second, frozen model of the same shape
(built without DDP as the actor builds its reference, starting from the policy's weights), then
`train_step` with the policy loss (PPO clip, entropy as a metric) plus a low_var_kl loss to the
reference (`kl_loss_coef` 0.01) on per-sample advantages; prompts are the first quarter of each
sequence, responses the rest. `--reuse-log-probs` times what the train actor does when a rollout is one
optimizer step (slime's can_reuse_log_probs_in_loss, docs/rl.md): no old-policy pass, the loss takes its own
log-probs, detached, as the old ones (`StepSettings.reuse_log_probs`); the reference pass stays. Prints one
JSON line per configuration:

* tokens/s = tokens per step (global batch x sequence) / median step time;
* MFU = 6 * params * tokens/s / peak (params counts the tied embedding once: it is the output
  layer's matmul), and `mfu_with_attention` adds the causal attention matmuls
  (6 * layers * seq * hidden per token, i.e. half of the full 12 L s h); `bench/mfu.py`, shared with
  the plain-PyTorch reference `bench/torch_reference.py`;
* with `--loss grpo` the step includes the two forward-only passes, each counted as 2 * params per
  token (attention likewise a third of the train figure): 10 N in all (8 N with `--reuse-log-probs`: one
  pass); `logprobs_s` and `train_s` split the step time;
* peak is H100 dense bf16, 989 TFLOP/s, unless `--peak-tflops` says otherwise.
With `--lora-rank R` every linear layer gets rank-R adapters on the frozen base (docs/lora.md): the
base's weight gradients are skipped, so the same MFU formula (6 x params) overstates the work done;
compare `tokens_per_s` and `peak_mem_gib` with the full run instead.
`--no-fused-adam` (or `--fused-adam`), `--megatron gradient_accumulation_fusion=false` and `--megatron
apply_rope_fusion=false` override the default kernel choices (docs/megatron.md) for an A/B in one session;
so do `--fp32-logits` (megatron's fp32 upcast of the logits before scoring), `--no-rope-cos-sin-cache`,
`--no-foreach-param-copy`, `--no-host-trims` (megatron's per-call autocast context and tp_group warning in its
linear layers, slime/backends/megatron/host_trims.py; bench/host_cost.py) and `--log-probs-chunk-size 441` (the compiled scoring's backward in chunks written and
copied into the logits' gradient, instead of one kernel over the whole logits; 441 is the default chunk at
micro-batch 1 and a 152k vocabulary) (the work removed after bench/op_census.py's census, docs/megatron.md);
the JSON line says which ran. `--ab NAME` (fp32-logits, compile-scores, log-probs-chunk-size, rope-cos-sin-cache,
foreach-param-copy, host-trims, triton-rope, compiled-rope, triton-swiglu, swiglu-fusion) times one of those changes on and off in one process instead, alternating step
by step after the warm-up of both arms, and prints both medians and `off_over_on`: runs one after another drifted
by more than the changes on a shared H100 (docs/benchmarks.md). `--against-reference` times the plain-PyTorch reference
(bench/torch_reference.py's model and step: HF Qwen2, SDPA, fused AdamW; `--reference-grad-checkpointing` to
checkpoint it, its own default) in the same process, alternating a Megatron step and a reference step after the
warm-up of both, so both run on the same GPU at the same moment: one JSON line with both medians and
`reference_over_megatron` (SFT only). `--host-profile 40` runs one more step under cProfile (and one reference
step with `--against-reference`) and prints the host functions that cost most: at 0.5B and micro-batch 1 the step
is bound by the host issuing kernels. `--megatron cuda_graph_impl=local` replays each transformer layer as CUDA
graphs (slime/backends/megatron/cuda_graphs.py): the first step records and captures them, so keep
`--warmup` >= 2; each further `--seq` captures anew. `--profile 30` then profiles one more step
(torch.profiler) and prints its 30 costliest GPU operations. Needs CUDA (no Ray, no Prefect).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from mfu import add_step_arguments, mfu_fields
from profiling import interleaved_ab, print_host_profile, print_profile

from slime.data.random_models import QWEN2_SHAPES, qwen2_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    parser.add_argument("--loss", choices=("sft", "grpo"), default="sft",
                        help="sft: SFT steps; grpo: old and reference log-probs, then the policy loss with KL")
    parser.add_argument("--reuse-log-probs", action="store_true",
                        help="--loss grpo: skip the old-policy pass, the loss reuses its own log-probs (one step "
                             "per rollout, as the train actor does then)")
    parser.add_argument("--log-probs-chunk-size", type=int, default=-1,
                        help="train.log_probs_chunk_size: response positions scored per chunk (-1: the default)")
    parser.add_argument("--compile-scores", action=argparse.BooleanOptionalAction, default=None,
                        help="train.compile_scores: the log-softmax over the vocabulary torch.compile'd (default: "
                             "on under CUDA with Triton); --no-compile-scores for the eager kernels")
    parser.add_argument("--fp32-logits", action=argparse.BooleanOptionalAction, default=False,
                        help="train.fp32_logits: megatron's Float16Module upcasts the logits to fp32 before they are "
                             "scored (the default before it was off); off: scored from the bf16 logits, same values")
    parser.add_argument("--rope-cos-sin-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="apply_rope_fusion's cos/sin once per angle table (rope_fusion.cached_cos_sin, the "
                             "default); --no-rope-cos-sin-cache: at every layer's query and key, as before")
    parser.add_argument("--foreach-param-copy", action=argparse.BooleanOptionalAction, default=True,
                        help="the optimizer's fp32 -> bf16 parameter copy as one foreach copy (the default); "
                             "--no-foreach-param-copy: megatron's copy_ per parameter")
    parser.add_argument("--host-trims", action=argparse.BooleanOptionalAction, default=True,
                        help="slime/backends/megatron/host_trims.py: megatron's linear layers without their per-call "
                             "autocast context and tp_group deprecation warning (the default); --no-host-trims: as "
                             "megatron has them")
    parser.add_argument("--log-probs-max-tokens", type=int, default=None, metavar="N",
                        help="--loss grpo: the forward-only log-prob passes packed by tokens, N per micro-batch (the "
                             "train actor's --use-dynamic-batch-size --log-probs-max-tokens-per-gpu N; training "
                             "here keeps --micro-batch)")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on every linear layer")
    parser.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x rank")
    parser.add_argument("--fused-adam", action=argparse.BooleanOptionalAction, default=None,
                        help="train.fused_adam: torch's fused AdamW kernel (default: on under CUDA without Apex/TE)")
    parser.add_argument("--megatron", action="append", default=[], metavar="KEY=VALUE",
                        help="a model option of the config's megatron section (a TransformerConfig field, the value "
                             "read as YAML), as a run would set it, e.g. gradient_accumulation_fusion=false, "
                             "apply_rope_fusion=false, recompute_granularity=selective; repeatable")
    parser.add_argument("--ab", choices=sorted(AB_SWITCHES), default=None,
                        help="time the step with this change on (the default) and off, alternating step by step in one "
                             "process, --steps each after --warmup of each; one JSON line with both medians")
    parser.add_argument("--against-reference", action="store_true",
                        help="time bench/torch_reference.py's plain-PyTorch step in this process too, alternating "
                             "step by step with this project's (SFT only)")
    parser.add_argument("--reference-grad-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                        help="--against-reference: the reference with gradient checkpointing (default: without, "
                             "its fastest at the memory these shapes need)")
    parser.add_argument("--host-profile", type=int, default=0, metavar="ROWS",
                        help="after the timed steps, one more under cProfile: its ROWS costliest host functions")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after the timed steps, one more under torch.profiler: print its ROWS costliest "
                             "GPU operations (self time, the whole step's GPU time first)")
    args = parser.parse_args()
    megatron = megatron_options(args.megatron)
    if not torch.cuda.is_available():
        raise SystemExit("bench/train_step.py needs CUDA")
    if args.log_probs_max_tokens is not None and args.loss != "grpo":
        raise SystemExit("--log-probs-max-tokens needs --loss grpo (it packs the forward-only log-prob passes)")
    if args.reuse_log_probs and args.loss != "grpo":
        raise SystemExit("--reuse-log-probs needs --loss grpo (it skips the old-policy log-prob pass)")
    if args.loss == "grpo" and args.lora_rank:
        raise SystemExit("--loss grpo with --lora-rank is not measured here: the LoRA reference is the frozen "
                         "base with its starting adapters, not a second model")

    from slime.backends.megatron import cuda_graphs, score_kernels
    from slime.backends.megatron.lora import count_parameters
    from slime.backends.megatron.optimizer import torch_optimizers
    from slime.backends.megatron.train import StepSettings, train_step
    from slime.types import Sample

    if args.against_reference and (args.loss != "sft" or args.lora_rank or args.ab):
        raise SystemExit("--against-reference times SFT steps of the full model (no --loss grpo, --lora-rank or "
                         "--ab): the reference has neither")
    if args.ab and (cuda_graphs.requested(megatron) or len(args.seq) > 1):
        raise SystemExit("--ab needs one --seq and no CUDA graphs (a graph replays what it captured: a switch "
                         "changed between steps would not reach it)")

    shape = QWEN2_SHAPES[args.model]
    config = qwen2_config(args.model, max_position_embeddings=32768)
    bridge, models, ref_models, optimizer = build_megatron(
        config, torch.bfloat16, megatron, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        fused_adam=args.fused_adam, rope_cos_sin_cache=args.rope_cos_sin_cache, trims=args.host_trims,
        foreach_param_copy=args.foreach_param_copy, reference=args.loss == "grpo")
    kernels = {"fused_adam": any(g.get("fused") for o in torch_optimizers(optimizer) for g in o.param_groups),
               "grad_accum_fusion": bridge.config.gradient_accumulation_fusion,
               "rope_fusion": bridge.config.apply_rope_fusion, "cuda_graphs": cuda_graphs.enabled(models),
               "compiled_scores": score_kernels.use_compiled(args.compile_scores, torch.device("cuda")),
               "fp32_logits": args.fp32_logits, "rope_cos_sin_cache": args.rope_cos_sin_cache,
               "foreach_param_copy": args.foreach_param_copy, "host_trims": args.host_trims}
    params = sum(p.numel() for p in models[0].parameters())
    reference = None
    if args.against_reference:
        import torch_reference

        torch.manual_seed(0)
        reference = torch_reference.build(config, torch.device("cuda"), args.reference_grad_checkpointing)
    grpo = args.loss == "grpo"
    settings = StepSettings(loss_type="policy_loss" if grpo else "sft_loss", micro_batch_size=args.micro_batch,
                            use_kl_loss=grpo, kl_loss_coef=0.01, kl_loss_type="low_var_kl",
                            log_probs_chunk_size=args.log_probs_chunk_size, reuse_log_probs=args.reuse_log_probs,
                            compile_scores=args.compile_scores, fp32_logits=args.fp32_logits)
    generator = torch.Generator().manual_seed(0)
    for n, seq in enumerate(args.seq):
        if n and cuda_graphs.enabled(models):  # graphs replay one shape: capture again for this length
            cuda_graphs.reset(models)
        response = seq - seq // 4 if grpo else seq - 1
        samples = [Sample(index=i, tokens=torch.randint(0, config.vocab_size, (seq,), generator=generator).tolist(),
                          response_length=response) for i in range(args.global_batch)]
        advantages = torch.randn(args.global_batch, generator=generator).tolist()  # GRPO: one per sample
        if reference is not None:
            print(json.dumps(against_reference(models, optimizer, reference, samples, settings, config.vocab_size,
                                               args, seq, params, shape)), flush=True)
            if args.host_profile:
                print_host_profile(lambda s=samples: train_step(models, optimizer, s, settings,
                                                                vocab_size=config.vocab_size),
                                   args.host_profile, "this project's step")
                print_host_profile(reference_step(reference, samples, args.micro_batch), args.host_profile,
                                   "plain PyTorch step")
            continue
        if args.ab:
            state = {"settings": settings, "models": models}

            def one_step(samples: list[Sample] = samples, advantages: list[float] = advantages,
                         state: dict[str, Any] = state) -> None:
                arrays = grpo_arrays(models, ref_models, samples, advantages, state["settings"], config.vocab_size,
                                     args.log_probs_max_tokens) if grpo else None
                train_step(models, optimizer, samples, state["settings"], vocab_size=config.vocab_size, arrays=arrays)

            toggle = AB_SWITCHES[args.ab](state)
            warm = interleaved_ab(one_step, toggle, args.warmup, sync=torch.cuda.synchronize)  # compiles both arms
            result = interleaved_ab(one_step, toggle, args.steps, sync=torch.cuda.synchronize)
            print(json.dumps({"model": args.model, "loss_kind": args.loss, "seq": seq, "global_batch": args.global_batch,
                              "micro_batch": args.micro_batch, "lora_rank": args.lora_rank, "ab": args.ab,
                              "on_step_s": round(result["on"], 4), "off_step_s": round(result["off"], 4),
                              "off_over_on": round(result["off"] / result["on"], 4), "steps_each": args.steps,
                              "warmup_on_s": round(warm["on"], 4), "device": torch.cuda.get_device_name()}), flush=True)
            continue
        times, logprob_times = [], []
        torch.cuda.reset_peak_memory_stats()
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            arrays = None
            if grpo:
                arrays = grpo_arrays(models, ref_models, samples, advantages, settings, config.vocab_size,
                                     args.log_probs_max_tokens)
                torch.cuda.synchronize()
                logprob_s = time.perf_counter() - start
            metrics = train_step(models, optimizer, samples, settings, vocab_size=config.vocab_size, arrays=arrays)
            torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
                logprob_times.append(logprob_s if grpo else 0.0)
        step_s = statistics.median(times)
        tokens_per_s = args.global_batch * seq / step_s
        extra = {}
        if grpo:
            logprobs_s = statistics.median(logprob_times)
            extra = {"logprobs_s": round(logprobs_s, 4), "train_s": round(statistics.median(
                [t - lp for t, lp in zip(times, logprob_times, strict=True)]), 4),
                "pg_loss": round(metrics["pg_loss"], 4), "kl_loss": round(metrics["kl_loss"], 4)}
        print(json.dumps({
            "model": args.model, "loss_kind": args.loss, "params": params, "seq": seq,
            "global_batch": args.global_batch, "micro_batch": args.micro_batch, "step_s": round(step_s, 4),
            "steps": args.steps, "lora_rank": args.lora_rank, "log_probs_chunk_size": args.log_probs_chunk_size,
            "megatron": megatron, "reuse_log_probs": args.reuse_log_probs,
            "log_probs_max_tokens": args.log_probs_max_tokens,
            "trainable_params": count_parameters(models)["trainable"], "tokens_per_s": round(tokens_per_s),
            **mfu_fields(params, shape["num_hidden_layers"], shape["hidden_size"], seq, tokens_per_s,
                         peak_tflops=args.peak_tflops,
                         forward_passes=(1 if args.reuse_log_probs else 2) if grpo else 0),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            # the caching allocator freeing its cache to retry a failed cudaMalloc: each is a device-wide sync
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
            "loss": round(metrics["loss" if grpo else "sft_loss"], 3), **kernels, **extra,
            "device": torch.cuda.get_device_name()}), flush=True)
        def step(samples: list[Sample] = samples, advantages: list[float] = advantages) -> None:
            arrays = grpo_arrays(models, ref_models, samples, advantages, settings, config.vocab_size,
                                 args.log_probs_max_tokens) if grpo else None
            train_step(models, optimizer, samples, settings, vocab_size=config.vocab_size, arrays=arrays)

        if args.host_profile:
            print_host_profile(step, args.host_profile, "this project's step")
        if args.profile:
            print_profile(step, args.profile)


def reference_step(reference: tuple[torch.nn.Module, torch.optim.Optimizer], samples: list[Any],
                   micro_batch: int) -> Callable[[], float]:
    """bench/torch_reference.py's step on the same token sequences as this project's step, the tokens put on the
    device once here (as torch_reference.py does before its timed steps), not in every timed step."""
    import torch_reference

    model, optimizer = reference
    tokens = torch.tensor([sample.tokens for sample in samples], device=next(model.parameters()).device)
    return lambda: torch_reference.train_step(model, optimizer, tokens, micro_batch)


def against_reference(models: list[torch.nn.Module], optimizer: Any,
                      reference: tuple[torch.nn.Module, torch.optim.Optimizer], samples: list[Any], settings: Any,
                      vocab_size: int, args: argparse.Namespace, seq: int, params: int,
                      shape: dict[str, int]) -> dict[str, Any]:
    """This project's SFT step and the plain-PyTorch reference's, alternating step by step in this process (`--warmup`
    of each first, then `--steps` each): both arms meet the same GPU, clocks and neighbours, where runs one after
    another on the same machine differed by more than the gap measured (docs/benchmarks.md)."""
    from slime.backends.megatron.train import train_step

    state = {"megatron": True}
    plain_step = reference_step(reference, samples, args.micro_batch)

    def one_step() -> None:
        if state["megatron"]:
            train_step(models, optimizer, samples, settings, vocab_size=vocab_size)
        else:
            plain_step()

    def toggle(on: bool) -> None:
        state["megatron"] = on

    cuda = torch.cuda.is_available()  # the CPU only in tests
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    interleaved_ab(one_step, toggle, args.warmup, sync=sync)
    result = interleaved_ab(one_step, toggle, args.steps, sync=sync)
    tokens = args.global_batch * seq
    fields = {}
    for arm, step_s in (("megatron", result["on"]), ("reference", result["off"])):
        mfu = mfu_fields(params, shape["num_hidden_layers"], shape["hidden_size"], seq, tokens / step_s,
                         peak_tflops=args.peak_tflops)
        fields.update({f"{arm}_step_s": round(step_s, 4), f"{arm}_tokens_per_s": round(tokens / step_s),
                       f"{arm}_mfu": mfu["mfu"], f"{arm}_mfu_with_attention": mfu["mfu_with_attention"]})
    return {"model": args.model, "seq": seq, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
            "megatron": megatron_options(args.megatron), "steps_each": args.steps, **fields,
            "reference_over_megatron": round(result["off"] / result["on"], 4),
            "reference_grad_checkpointing": args.reference_grad_checkpointing,
            "peak_mem_gib_both": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def _settings_switch(**off: Any) -> Callable[[dict[str, Any]], Callable[[bool], None]]:
    """A switch of `StepSettings` fields: on = the settings the run was started with, off = with `off` replaced."""
    def make(state: dict[str, Any]) -> Callable[[bool], None]:
        on_settings = state["settings"]
        off_settings = dataclasses.replace(on_settings, **off)

        def toggle(on: bool) -> None:
            state["settings"] = on_settings if on else off_settings
        return toggle
    return make


def _process_switch(apply: Callable[[bool], object]) -> Callable[[dict[str, Any]], Callable[[bool], None]]:
    """A switch that is process-wide state (installed functions): on = the change in place."""
    return lambda state: lambda on: apply(on)


def _rope_cache(on: bool) -> None:
    from slime.backends.megatron import rope_fusion

    rope_fusion.install(cache_cos_sin=on)


def _rope_kernels(on: str, off: str) -> Callable[[bool], None]:
    def toggle(use_on: bool) -> None:
        from slime.backends.megatron import rope_fusion

        rope_fusion.install(kernel=on if use_on else off)
    return toggle


def _swiglu_fusion(state: dict[str, Any]) -> Callable[[bool], None]:
    """megatron's compiled SwiGLU (`bias_activation_fusion`, read by each MLP at every forward) against its eager
    `glu` (chunk, silu, mul)."""
    from mbridge.core.util import unwrap_model

    configs = {id(m.config): m.config for m in unwrap_model(state["models"]) if hasattr(m, "config")}.values()

    def toggle(on: bool) -> None:
        for config in configs:
            config.bias_activation_fusion = on
    return toggle


def _triton_swiglu(on: bool) -> None:
    from slime.backends.megatron import swiglu_kernel

    swiglu_kernel.install(on)


def _host_trims(on: bool) -> None:
    from slime.backends.megatron import host_trims

    host_trims.install(on)


def _foreach_copy(on: bool) -> None:
    from slime.backends.megatron.optimizer import use_foreach_param_copy

    use_foreach_param_copy(on)


# --ab NAME: each change of the op census and the host trims, on (the default) against off, in one process
AB_SWITCHES: dict[str, Callable[[dict[str, Any]], Callable[[bool], None]]] = {
    "fp32-logits": _settings_switch(fp32_logits=True),  # off: megatron's fp32 upcast of the logits
    "compile-scores": _settings_switch(compile_scores=False),
    "log-probs-chunk-size": _settings_switch(log_probs_chunk_size=441),  # off: the chunked scoring backward
    "rope-cos-sin-cache": _process_switch(_rope_cache),
    "foreach-param-copy": _process_switch(_foreach_copy),
    "host-trims": _process_switch(_host_trims),
    # the compiled regions' host cost (a torch.compile'd call costs the host more than a few eager kernels)
    "triton-rope": _process_switch(_rope_kernels("triton", "compiled")),  # off: the compiled rotation
    "compiled-rope": _process_switch(_rope_kernels("compiled", "eager")),  # compiled against eager kernels
    "swiglu-fusion": _swiglu_fusion,  # off: megatron's eager SwiGLU
    "triton-swiglu": _process_switch(_triton_swiglu),  # off: megatron's compiled SwiGLU
}


def build_megatron(config: Any, dtype: torch.dtype, megatron: dict[str, Any], *, lora_rank: int = 0,
                   lora_alpha: float | None = None, fused_adam: bool | None = None, rope_cos_sin_cache: bool = True,
                   trims: bool = True, foreach_param_copy: bool = True,
                   reference: bool = False) -> tuple[Any, list[torch.nn.Module], list[torch.nn.Module] | None, Any]:
    """(bridge, models, reference models or None, optimizer): the random-weight Megatron model of an HF `config`
    (mbridge needs only the config), wrapped for training, with the kernel switches the benchmarks A/B
    (`rope_cos_sin_cache`, host `trims`, `foreach_param_copy`, `fused_adam`); `reference`: a KL reference model.
    bench/host_cost.py and bench/op_census.py build theirs here too."""
    from slime.backends.megatron import host_trims, rope_fusion
    from slime.backends.megatron.bridge import build_model, init_megatron, make_bridge
    from slime.backends.megatron.lora import LoraSpec, lora_callback
    from slime.backends.megatron.optimizer import build_optimizer, use_foreach_param_copy

    init_megatron(seed=0, megatron=megatron)
    with tempfile.TemporaryDirectory() as hf_dir:
        config.save_pretrained(hf_dir)
        bridge = make_bridge(hf_dir, dtype, megatron=megatron)
        if not rope_cos_sin_cache:
            rope_fusion.install(cache_cos_sin=False)
        host_trims.install(trims)
        spec = LoraSpec(rank=lora_rank, alpha=lora_alpha or 2.0 * lora_rank, dropout=0.0,
                        targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) if lora_rank else None
        models = build_model(bridge, wrap_with_ddp=True, post_create=lora_callback(spec))
        ref_models = reference_model(bridge, models) if reference else None
    optimizer = build_optimizer(models, lr=1e-5, clip_grad=1.0, bf16=dtype is torch.bfloat16, fused_adam=fused_adam)
    use_foreach_param_copy(foreach_param_copy)
    return bridge, models, ref_models, optimizer


def megatron_options(pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings as the megatron section's entries (values parsed as YAML: numbers, booleans, lists);
    a key that is no model option (`bridge.model_options` would drop it) is refused, so a typo cannot time the
    default instead."""
    import yaml

    from slime.backends.megatron.bridge import model_options

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--megatron {pair!r}: expected KEY=VALUE")
        options[key.strip()] = yaml.safe_load(value)
    unknown = sorted(set(options) - set(model_options(options)))
    if unknown:
        raise SystemExit(f"--megatron {', '.join(unknown)}: not a model option (a field of megatron-core's "
                         "TransformerConfig, or gradient_accumulation_fusion)")
    return options


def grpo_arrays(models: list[torch.nn.Module], ref_models: list[torch.nn.Module], samples: list[Any],
                advantages: list[float], settings: Any, vocab_size: int, max_tokens: int | None = None) -> Any:
    """What the train actor computes before a GRPO step: old-policy (unless `settings.reuse_log_probs`) and
    reference log-probs (forward only); `max_tokens`: those passes packed by tokens (dynamic batch size)."""
    from slime.backends.megatron.logprobs import compute_log_probs
    from slime.backends.megatron.step_data import TrainArrays

    batching = dict(vocab_size=vocab_size, micro_batch_size=settings.micro_batch_size,
                    chunk_size=settings.log_probs_chunk_size, temperature=settings.temperature,
                    compile_scores=settings.compile_scores, fp32_logits=settings.fp32_logits,
                    use_dynamic_batch_size=max_tokens is not None,
                    max_tokens_per_gpu=max_tokens)
    old = None if settings.reuse_log_probs else compute_log_probs(models, samples, **batching).log_probs
    return TrainArrays(advantages=advantages, old_log_probs=old,
                       ref_log_probs=compute_log_probs(ref_models, samples, **batching).log_probs)


def reference_model(bridge: Any, models: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """A frozen model of the policy's shape holding the policy's weights (the actor's reference model)."""
    from mbridge.core.util import unwrap_model

    from slime.backends.megatron.bridge import build_model

    ref_models = build_model(bridge)
    with torch.no_grad():
        for policy, ref in zip(unwrap_model(models), ref_models, strict=True):
            for (name, src), (_, dst) in zip(policy.named_parameters(), ref.named_parameters(), strict=True):
                if src.shape != dst.shape:
                    raise SystemExit(f"reference model differs from the policy at {name}")
                dst.copy_(src)
    for model in ref_models:
        model.requires_grad_(False)
        model.eval()
    return ref_models


if __name__ == "__main__":
    main()
