"""The built-in engine on GLM-4.5 (`glm4_moe`) beyond what test_builtin_moe.py checks for every MoE model (router,
dispatch, slot decoder, engine tokens / log-probs / routed experts against `transformers`): in-place weight updates of
every kind of GLM-4.5 tensor (per-expert names, the shared expert, the router and its expert-bias *buffer*, the dense
first layer) leave the engine equal to one freshly loaded from the updated checkpoint; the multi-token-prediction
layer a GLM-4.5 checkpoint ships is left unread with one log line, at load and in updates; and what the engine cannot
run is refused at start, naming the field. On CPU in fp32, on random_models' "tiny" GLM-4.5 (test_builtin_moe's
`tiny_glm`: its expert bias and q/k/v biases drawn)."""

import asyncio
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_builtin_moe import PROMPTS, decode_routing, hf_routing, teacher_forced, tiny_glm

from slime.data.random_models import glm4_moe_config
from slime.data.tiny import build_tokenizer
from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.errors import ConfigError
from slime.sync.tensor import _FileSystemSharing, pack_bucket, serialize_named_tensors

ATOL = 1e-5  # fp32, as test_builtin_moe.py
LAYERS, TOP_K = 3, 2  # random_models' tiny GLM-4.5


def generate(engine, body):
    return asyncio.run(engine.generate(body))


def save(model, path, extra: dict | None = None):
    """`model` as a checkpoint (its experts one tensor each, as `save_pretrained` writes them) plus `extra` tensors."""
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    if extra:
        state = load_file(str(path / "model.safetensors"))
        save_file({**state, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def mtp_tensors(seed: int = 7) -> dict[str, torch.Tensor]:
    """Tensors of a GLM-4.5 MTP layer (`model.layers.{num_hidden_layers}`, names as the released checkpoints')."""
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{LAYERS}"
    shapes = {"eh_proj.weight": (64, 128), "enorm.weight": (64,), "hnorm.weight": (64,),
              "shared_head.norm.weight": (64,), "self_attn.q_proj.weight": (64, 64),
              "mlp.experts.0.gate_proj.weight": (32, 64), "mlp.gate.e_score_correction_bias": (8,)}
    return {f"{prefix}.{name}": torch.randn(shape, generator=g) for name, shape in shapes.items()}


def serialized(named):
    with _FileSystemSharing():
        views, flats = pack_bucket(named)
        return [serialize_named_tensors(views)], flats


def outputs(engine):
    """Greedy rows of unequal budgets with log-probs and routed experts, and a prompt scored."""
    outs = generate(engine, {"input_ids": PROMPTS, "return_logprob": True, "return_routed_experts": True,
                             "sampling_params": [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
                                                 for n in (8, 5, 11, 3)]})
    scored = generate(engine, {"input_ids": PROMPTS[0], "return_logprob": True, "logprob_start_len": 0,
                               "sampling_params": {"max_new_tokens": 0}})
    return outs, scored


def gap(a, b) -> float:
    """Max |log-prob| difference of two `outputs`; asserts equal tokens and routed experts."""
    (outs_a, scored_a), (outs_b, scored_b) = a, b
    worst = 0.0
    for x, y in zip(outs_a, outs_b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        assert x["meta_info"]["routed_experts"] == y["meta_info"]["routed_experts"]
        for (p, _, _), (q, _, _) in zip(x["meta_info"]["output_token_logprobs"], y["meta_info"]["output_token_logprobs"],
                                        strict=True):
            worst = max(worst, abs(p - q))
    for (p, _, _), (q, _, _) in zip(scored_a["meta_info"]["input_token_logprobs"][1:],
                                    scored_b["meta_info"]["input_token_logprobs"][1:], strict=True):
        worst = max(worst, abs(p - q))
    return worst


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    """The first weights; its config declares one MTP layer, as GLM-4.5's does (its checkpoint here has none)."""
    return save(tiny_glm(num_nextn_predict_layers=1), tmp_path_factory.mktemp("glm"))


@pytest.fixture(scope="module")
def updated(tmp_path_factory):
    """Another random GLM-4.5 (every tensor, expert bias included, drawn anew) saved with an MTP layer as GLM-4.5
    ships one (`num_nextn_predict_layers=1`): (model, checkpoint dir)."""
    model = tiny_glm(seed=5, num_nextn_predict_layers=1)
    path = tmp_path_factory.mktemp("glm-updated")
    model.save_pretrained(path)
    written = load_file(str(path / "model.safetensors"))
    # transformers 5.24 builds no MTP layer, so save_pretrained writes none: the test adds one as the checkpoints have
    assert not any(name.startswith(f"model.layers.{LAYERS}.") for name in written)
    return model, save(model, path, mtp_tensors())


def test_checkpoint_mtp_layer_is_ignored_with_one_log_line(updated, caplog, capfd):
    model, path = updated
    with caplog.at_level(logging.INFO, logger="slime.engines.builtin"):
        engine = BuiltinEngine(EngineArgs(model_path=str(path), kv_cache="slots"))
    try:
        lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
        assert lines == ["ignoring the checkpoint's 7 multi-token-prediction tensors (model.layers.3.*, "
                         "num_nextn_predict_layers=1): the built-in engine does no speculative decoding"]
        assert "UNEXPECTED" not in capfd.readouterr().err  # transformers' load report is not shown for them
        assert len(engine.model.model.layers) == LAYERS
        (outs, _) = outputs(engine)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            logprobs = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(logprobs, teacher_forced(model, prompt, out["output_ids"]), rtol=0, atol=ATOL)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kv_cache", ["slots", "dynamic"])
def test_weight_updates_equal_a_freshly_loaded_engine(glm_dir, updated, kv_cache, tmp_path, caplog):
    """Every tensor of the updated model by tensor (per-expert names, the shared expert, the router weight and its
    expert-bias buffer, the dense layer's MLP; its MTP tensors skipped), in place; then the engine generates, scores
    and routes as an engine started on the updated checkpoint; and so after a disk update from it."""
    model, path = updated
    engine = BuiltinEngine(EngineArgs(model_path=str(glm_dir), kv_cache=kv_cache))
    fresh = BuiltinEngine(EngineArgs(model_path=str(path), kv_cache=kv_cache))
    try:
        before = outputs(engine)
        live = engine.model.model.layers
        pointers = [t.data_ptr() for t in (live[1].mlp.experts.gate_up_proj, live[1].mlp.gate.weight,
                                           live[1].mlp.gate.e_score_correction_bias,
                                           live[2].mlp.shared_experts.down_proj.weight, live[0].mlp.down_proj.weight)]
        state = {**load_file(str(path / "model.safetensors"))}
        named = sorted(state.items())
        assert any(".experts.3.up_proj.weight" in n for n, _ in named) and any("e_score_correction_bias" in n
                                                                               for n, _ in named)
        text, _flats = serialized(named)
        with caplog.at_level(logging.INFO, logger="slime.engines.builtin"):
            result = engine.update_weights_from_tensor({"serialized_named_tensors": text, "weight_version": "v2"})
        assert result["success"], result["message"]
        assert result["message"].startswith(f"updated {len(named) - 7} tensors")  # the 7 MTP tensors skipped
        assert any("skipped 7 multi-token-prediction tensors" in r.getMessage() for r in caplog.records)
        assert [t.data_ptr() for t in (live[1].mlp.experts.gate_up_proj, live[1].mlp.gate.weight,
                                       live[1].mlp.gate.e_score_correction_bias,
                                       live[2].mlp.shared_experts.down_proj.weight,
                                       live[0].mlp.down_proj.weight)] == pointers
        for name, tensor in model.state_dict().items():
            assert torch.equal(engine.model.state_dict()[name], tensor), name
        after, want = outputs(engine), outputs(fresh)
        assert gap(after, want) == 0.0  # the same weights, the same code: bit-equal
        assert [o["output_ids"] for o in after[0]] != [o["output_ids"] for o in before[0]]
        for prompt, out in zip(PROMPTS, after[0], strict=True):  # and the updated model's own routing
            sequence = prompt + out["output_ids"]
            routed = decode_routing(out["meta_info"], len(sequence) - 1, LAYERS, TOP_K)
            assert np.array_equal(routed, hf_routing(model, sequence)[:-1])

        # back to the first weights from disk, then the updated ones (with their MTP layer) again
        assert engine.update_weights_from_disk(str(glm_dir), "v1")["success"]
        assert gap(outputs(engine), before) == 0.0
        result = engine.update_weights_from_disk(str(path), "v3")
        assert result["success"], result["message"]
        assert gap(outputs(engine), want) == 0.0
    finally:
        engine.shutdown()
        fresh.shutdown()


def test_expert_bias_update_steers_the_routing(glm_dir):
    """The expert bias is a buffer, read at every step (slot decode and prefill): +10 on experts 6 and 7 makes every
    token of every MoE layer route to them (their group wins the group choice, then they the top-2), while the
    weights stay the unbiased scores (log-probs still equal the `transformers` model with that bias)."""
    engine = BuiltinEngine(EngineArgs(model_path=str(glm_dir), kv_cache="slots"))
    try:
        bias = torch.zeros(8)
        bias[6:] = 10.0
        named = [(f"model.layers.{i}.mlp.gate.e_score_correction_bias", bias) for i in (1, 2)]
        text, _flats = serialized(named)
        assert engine.update_weights_from_tensor({"serialized_named_tensors": text})["success"]
        reference = tiny_glm()
        reference.load_state_dict(engine.model.state_dict())
        (outs, _) = outputs(engine)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            sequence = prompt + out["output_ids"]
            routed = decode_routing(out["meta_info"], len(sequence) - 1, LAYERS, TOP_K)
            assert (routed[:, 0] == -1).all()
            assert (np.sort(routed[:, 1:], axis=-1) == [6, 7]).all()
            logprobs = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(logprobs, teacher_forced(reference, prompt, out["output_ids"]), rtol=0,
                                       atol=ATOL)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("override", "message"), [
    ({"n_group": 3}, "n_group 3 does not divide n_routed_experts 8"),
    ({"n_group": 8}, "n_group 8 leaves 1 expert per group"),
    ({"topk_group": 3}, r"topk_group 3 must lie in \[1, n_group=2\]"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok 5 must lie in \[1, 4\]"),
])
def test_unsupported_router_is_refused_at_start_naming_the_field(tmp_path, override, message):
    """Refused before any weight is read (only a config.json here)."""
    glm4_moe_config("tiny", **override).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"glm4_moe config: {message}"):
        BuiltinEngine(EngineArgs(model_path=str(tmp_path)))
