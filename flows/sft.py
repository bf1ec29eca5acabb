"""Flow `sft`: supervised fine-tuning of the run's converted model into `{store}/{run_id}/sft/`.

    python -m flows.sft --config deployments/tiny-cpu.yaml [--run-id ID] [--model CKPT] [--sft-num-epoch 1]

Without `--model` it starts from the run's newest committed `convert` checkpoint.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from flows._cli import DEFAULT_CONFIG, main
from flows._stage import newest_model, output_uri, resolve_run, run_name, run_stage
from tasks.sft import OUTPUT_NAME, sft


@flow(name="sft", flow_run_name=run_name("sft"))
def sft_flow(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, store: str | None = None,
             run_id: str | None = None, model: str | None = None) -> dict[str, Any]:
    """Fine-tune `model` (default: the run's convert checkpoint) on sft.sft_data."""
    cfg, run_id = resolve_run(config, overrides, store, run_id)
    cfg.require("checkpoint.hf_checkpoint", "sft.sft_data", stage="sft")
    inputs = {"load": model or newest_model(cfg, run_id, ("convert",)), "sft_data": cfg.sft.sft_data,
              "hf_checkpoint": cfg.checkpoint.hf_checkpoint}
    # SFT's own schedule (sft_lr, ...) in place of train's: the cache key and the report then hold what SFT
    # trains with, and tuning RL's learning rate alone reuses a finished SFT
    cfg = cfg.model_copy(update={"train": cfg.sft_train()})
    return run_stage(sft, cfg, run_id, inputs, output_uri(cfg, run_id, "sft", OUTPUT_NAME))


if __name__ == "__main__":
    sys.exit(main(sft_flow, takes_model=True))
