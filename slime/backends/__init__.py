"""Training backends (Megatron-core)."""
