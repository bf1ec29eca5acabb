"""`export_hf_weights` without pipeline or expert parallelism skips mbridge's per-tensor pipeline
collectives, and still yields exactly what mbridge's `export_weights` yields: names, order, values
(CPU, gloo, the tiny kit; each layout in processes of its own, as Megatron's state is per process;
the `gpu` test: a 0.5B shape in bf16 on CUDA)."""

import types
from pathlib import Path

import pytest
import torch
from mbridge.core.parallel_states import ParallelStates
from megatron.core.transformer import TransformerConfig
from multirank import run_ranks

from slime.backends.megatron.bridge import uses_local_export
from slime.data.random_models import save_random_qwen2

SCRIPT = Path(__file__).with_name("export_fast.py")
LAYOUTS = {"tp1": ("tensor", 1), "tp2": ("tensor", 2), "pp2": ("pipeline", 2)}


@pytest.fixture(scope="module")
def exports(tiny_kit):
    """Each layout's JSON row per rank (export_fast.py)."""
    return {key: [rows[0] for rows in run_ranks(SCRIPT, world_size=world, args=[str(tiny_kit.model_dir), layout],
                                                timeout=600)]
            for key, (layout, world) in LAYOUTS.items()}


@pytest.mark.parametrize("key", ["tp1", "tp2"])
def test_local_export_equals_mbridge_without_object_collectives(exports, key):
    for row in exports[key]:
        assert row["local"]
        assert row["names"] == row["mbridge_names"]  # same names in the same order
        assert row["values_equal"] and row["second_export_equal"]  # torch.equal, tensor by tensor
        assert sorted(row["names"]) == row["checkpoint_names"] and row["equal_to_checkpoint"]  # TP shards merged
        assert row["object_collectives"]["export_hf_weights"] == 0
        assert row["object_collectives"]["mbridge"] > len(row["names"])  # what the fast path saves
        assert row["requires_grad"] == []  # views taken without building an autograd graph


def test_pipeline_parallel_export_goes_through_mbridge(exports):
    for row in exports["pp2"]:
        assert not row["local"]
        assert row["names"] == row["mbridge_names"] and row["values_equal"] and row["equal_to_checkpoint"]
        # mbridge yields the tied embedding from both stages (the last one's output layer); export once
        assert row["mbridge_repeated"] == ["model.embed_tokens.weight"]
        assert sorted(row["names"]) == row["checkpoint_names"]  # each once; every layer from the stage holding it
        assert row["object_collectives"]["export_hf_weights"] == row["object_collectives"]["mbridge"] > 0


def bridge_with(pp_size: int = 1, ep_size: int = 1, num_moe_experts: int | None = None) -> types.SimpleNamespace:
    """The two attributes `uses_local_export` reads, as mbridge holds them on a bridge."""
    moe = {"num_moe_experts": num_moe_experts, "moe_router_topk": 2} if num_moe_experts else {}
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **moe)
    return types.SimpleNamespace(mpu=ParallelStates(pp_size=pp_size, ep_size=ep_size), config=config)


@pytest.mark.parametrize(("setup", "local"), [
    ({}, True),
    ({"pp_size": 2}, False),
    ({"ep_size": 2, "num_moe_experts": 4}, False),
    ({"num_moe_experts": 4}, False),  # experts on one rank: mbridge's path, which knows MoE names
])
def test_uses_local_export_only_for_one_dense_stage(setup, local):
    assert uses_local_export(bridge_with(**setup)) is local


@pytest.mark.gpu
def test_local_export_equals_mbridge_on_cuda_bf16(tmp_path):
    """The real case: a Qwen2.5-0.5B shape in bf16 on one GPU (NCCL), where each object collective
    mbridge makes is a pickle into GPU memory and a device sync. Prints both paths' seconds."""
    if not torch.cuda.is_available():
        pytest.fail("gpu test run without CUDA")
    save_random_qwen2(tmp_path / "hf", "0.5b", torch.bfloat16)
    row = run_ranks(SCRIPT, world_size=1, args=[str(tmp_path / "hf"), "tensor", "bf16"], timeout=900)[0][0]
    print({key: row[key] for key in ("seconds", "bytes", "object_collectives")})
    assert row["local"] and row["names"] == row["mbridge_names"] and len(row["names"]) == 290
    assert row["values_equal"] and row["second_export_equal"] and row["equal_to_checkpoint"]
    assert row["object_collectives"]["export_hf_weights"] == 0 < row["object_collectives"]["mbridge"]
