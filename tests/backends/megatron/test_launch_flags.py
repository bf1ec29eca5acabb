"""Megatron-LM's model-shaping launch flags of slime's scripts (--rotary-percent, --use-rope-scaling,
--apply-layernorm-1p, --num-experts) are accepted only when they equal what the HF checkpoint gives."""

from script_rows import rows_by_case, run_script


def test_shape_launch_flags_must_equal_the_checkpoint(tiny_kit):
    rows = rows_by_case(run_script("launch_flags.py", tiny_kit.model_dir, timeout=300))
    assert rows["agree"]["refused"] is None and rows["agree"]["num_layers"] > 0, rows["agree"]
    # the tiny kit is a dense Qwen2: full rotary, no llama3 scaling, plain norm weights, no experts
    expected = {"rotary_percent": "--rotary-percent 0.5, but the checkpoint gives 1.0",
                "use_rope_scaling": "--use-rope-scaling True, but the checkpoint gives False",
                "apply_layernorm_1p": "--apply-layernorm-1p True, but the checkpoint gives False",
                "num_experts": "--num-experts 8, but the checkpoint gives None"}
    for case, message in expected.items():
        refused = rows[case]["refused"]
        assert refused and message in refused and f"megatron.{case}" in refused, (case, refused)
        assert str(tiny_kit.model_dir) in refused, refused
