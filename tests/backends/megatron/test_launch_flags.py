"""Megatron-LM's model-shaping launch flags of slime's scripts (--rotary-percent, --use-rope-scaling,
--apply-layernorm-1p, --num-experts) are accepted only when they equal what the HF checkpoint gives; FP8
(--fp8-format) is refused where there is no Transformer Engine."""

import importlib.util

from script_rows import rows_by_case, run_script

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None  # as slime.backends.megatron.bridge reads it


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
    fp8 = rows["fp8"]["refused"]  # --fp8-format e4m3 reaches the model options as fp8 (megatron_flags.LAUNCH)
    if HAVE_TE:
        assert fp8 is None, fp8
    else:
        assert fp8 and "megatron.fp8='e4m3' (--fp8-format, --fp8): FP8 training runs in Transformer Engine's layers" in fp8
