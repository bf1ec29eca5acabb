"""The megatron section's model options (megatron-core TransformerConfig fields) reach the model: slime
command lines carry them (--recompute-granularity, dropouts, the model's shape flags), and before they
were accepted and silently left out."""

from script_rows import run_script


def test_transformer_options_reach_the_model_and_shape_flags_must_agree(tiny_kit):
    row = run_script("model_options.py", tiny_kit.model_dir, timeout=300)[0]
    # only TransformerConfig's own fields: not the parallel sizes (init_megatron) nor scheduler flags
    assert row["options"] == ["hidden_dropout", "recompute_granularity", "recompute_method", "recompute_num_layers"]
    assert row["recompute_granularity"] == "full"
    assert row["plain_calls"] == 0 and row["recompute_calls"] == row["layers"], row  # each layer recomputed
    assert row["logit_gap"] == 0.0 and row["grad_gap"] < 1e-6, row
    assert row["refused"] and "megatron.num_layers" in row["refused"], row
