"""One rank of the LoRA tests (test_lora.py starts it through multirank.run_ranks).

    python lora_parity.py HF_DIR OUT_DIR   (RANK, WORLD_SIZE, INIT_METHOD in the environment)

All ranks form one tensor-parallel group (TP = world size). Builds the tiny model with adapters on every
linear layer (rank 4, alpha 8) beside the same model without, and prints one JSON line with:
logits of both at init (bit-equal?), which parameters are trainable / in the optimizer / have gradients,
two Adam policy steps with entropy and KL terms (their metrics), the base weights after them (unchanged?),
the reference forward (adapters disabled) against the base, the trained model's response log-probs, and the
`bmm` calls (input shapes) of the second step, profiled (micro-batch 2: frozen_linear.py).
Rank 0 writes the merged export to OUT_DIR/merged-tp<world>.safetensors and the PEFT adapter directory to
OUT_DIR/peft-tp<world>.
"""

import contextlib
import json
import sys
from pathlib import Path

import torch
from dp_parity import jitter
from multirank import rank_env
from parity_samples import make_samples
from safetensors.torch import save_file

from slime.backends.megatron import lora
from slime.backends.megatron.bridge import (
    build_model,
    close_megatron,
    export_hf_weights,
    init_megatron,
    make_bridge,
)
from slime.backends.megatron.logprobs import compute_log_probs, pad_samples
from slime.backends.megatron.lora_export import save_peft_adapter
from slime.backends.megatron.optimizer import build_optimizer
from slime.backends.megatron.step_data import TrainArrays
from slime.backends.megatron.train import StepSettings, train_step

SPEC = lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
                     seed=3)


def logits(models, samples) -> torch.Tensor:
    batch = pad_samples(samples)
    model = models[0]
    model.eval()
    with torch.no_grad():
        positions = torch.arange(batch.tokens.shape[1]).unsqueeze(0).expand_as(batch.tokens)
        return model(input_ids=batch.tokens, position_ids=positions, attention_mask=None)


def main() -> None:
    hf_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world_size, init_method = rank_env()
    init_megatron(seed=0, tensor_parallel=world_size, rank=rank, world_size=world_size, init_method=init_method)
    bridge = make_bridge(hf_dir)
    base = build_model(bridge, hf_dir)
    models = build_model(bridge, hf_dir, wrap_with_ddp=True, post_create=lora.lora_callback(SPEC))
    lora.set_base(models, hf_dir)
    vocab = bridge.hf_config.vocab_size
    samples = make_samples(vocab)
    init_equal = bool(torch.equal(logits(models, samples), logits(base, samples)))

    names = {id(p): n for n, p in models[0].module.named_parameters()}
    optimizer = build_optimizer(models, lr=1e-2, clip_grad=1.0, adam_eps=1e-3)
    in_optimizer = sorted(names[id(p)] for g in optimizer.param_groups for p in g["params"])
    scored = compute_log_probs(models, samples, vocab_size=vocab, micro_batch_size=2)
    arrays = TrainArrays(ref_log_probs=[jitter(v, 0.5, seed=200 + x.index) for v, x in zip(scored.log_probs, samples,
                                                                                          strict=True)])
    settings = StepSettings(loss_type="policy_loss", micro_batch_size=2, entropy_coef=0.05, use_kl_loss=True,
                            kl_loss_coef=0.2, kl_loss_type="k3")
    steps = []
    for step in range(2):
        with torch.profiler.profile(record_shapes=True) if step else contextlib.nullcontext() as prof:
            steps.append(train_step(models, optimizer, samples, settings, vocab_size=vocab, arrays=arrays))
        with_grad = sorted(n for n, p in models[0].module.named_parameters()
                           if getattr(p, "main_grad", None) is not None and bool(p.main_grad.abs().sum() > 0))
    bmm = sorted(str(e.input_shapes) for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::bmm")
    with_state = sorted(names[id(p)] for p, s in optimizer.optimizer.state.items() if s)
    base_params = dict(base[0].named_parameters())
    base_unchanged = all(torch.equal(p, base_params[n]) for n, p in models[0].module.named_parameters()
                         if not lora.is_adapter_name(n))
    b_moved = max(float(p.abs().max()) for n, p in models[0].module.named_parameters() if n.endswith("lora_b"))
    with lora.adapters_disabled(models):
        reference_is_base = bool(torch.equal(logits(models, samples), logits(base, samples)))
    trained = compute_log_probs(models, samples, vocab_size=vocab, micro_batch_size=2)
    weights = {name: t.detach().cpu().contiguous() for name, t in export_hf_weights(bridge, models)}
    save_peft_adapter(bridge, models, str(out_dir / f"peft-tp{world_size}"), base_model=hf_dir)
    if rank == 0:
        save_file(weights, str(out_dir / f"merged-tp{world_size}.safetensors"))
    print(json.dumps({
        "rank": rank, "init_logits_equal": init_equal, "reference_is_base": reference_is_base,
        "trainable": sorted(n for n, p in models[0].module.named_parameters() if p.requires_grad),
        "in_optimizer": in_optimizer, "with_state": with_state, "with_grad": with_grad,
        "all_params": sorted(names.values()), "base_unchanged": base_unchanged, "b_moved": b_moved,
        "counts": lora.count_parameters(models), "steps": steps, "bmm": bmm,
        "log_probs": [v.tolist() for v in trained.log_probs]}), flush=True)


if __name__ == "__main__":
    main()
    close_megatron()
