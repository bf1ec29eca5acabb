"""The Megatron-core training backend: mbridge conversion, model building, log-probs, train step,
checkpoints. On machines without CUDA it runs through `cpu_compat` (tiny models, tests, CI)."""
