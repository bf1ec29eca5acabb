"""Rollout: turn prompt groups into scored samples through the engines behind the router.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` is the default
`rollout_function_path` (slime's signature); rewards live in `slime.rollout.rewards`.
"""
