"""Data layer: prompt datasets, tokenizers and the data source that feeds rollout."""
