"""Prefect flows: the pipeline (convert -> sft -> rejection_sampling -> rl -> evaluate -> export)
and one flow per stage, orchestrating `tasks/`. Flows arrive with the stages they chain."""
