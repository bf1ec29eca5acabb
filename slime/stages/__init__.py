"""The pipeline's stages as library functions, one module each: `convert` (HF -> Megatron), `sft`,
`rejection_sampling`, `evaluate`, `export` (Megatron -> HF) and `export_check` (an export against its
checkpoint). Each takes the one `Config` and returns what its Prefect task (tasks/) records; the RL loop,
the largest stage, has its own room (slime/rl/). `definitions` says what defines each stage's artifact and
`record` decides, from the record beside an output, whether a stage is done, resumable or asked for with
other settings (both entry points, `slime <stage>` and the flows, ask it). No Prefect here."""
