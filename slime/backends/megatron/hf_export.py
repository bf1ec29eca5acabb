"""Write HF safetensors checkpoints from (name, tensor) pairs, sharded like transformers does: the writer lives in
slime/data/hf_weights.py (the generated kits' large random models use it too); the export and the weight syncs
import it from here."""

from slime.data.hf_weights import DEFAULT_MAX_SHARD_BYTES, save_hf_weights

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "save_hf_weights"]
