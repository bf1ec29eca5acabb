"""Flow `convert`: the config's HF checkpoint -> a Megatron checkpoint in `{store}/{run_id}/convert/`.

    python -m flows.convert --config deployments/tiny-cpu.yaml [--store URL] [--run-id ID]
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from flows._cli import DEFAULT_CONFIG, main
from flows._stage import output_uri, resolve_run, run_name, run_stage
from tasks.convert import OUTPUT_NAME, convert


@flow(name="convert", flow_run_name=run_name("convert"))
def convert_flow(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, store: str | None = None,
                 run_id: str | None = None) -> dict[str, Any]:
    """Convert the HF checkpoint (checkpoint.hf_checkpoint) into the run's Megatron checkpoint."""
    cfg, run_id = resolve_run(config, overrides, store, run_id, needs_device=False)
    cfg.require("checkpoint.hf_checkpoint", stage="convert")
    return run_stage(convert, cfg, run_id, {"hf_checkpoint": cfg.checkpoint.hf_checkpoint},
                     output_uri(cfg, run_id, "convert", OUTPUT_NAME))


if __name__ == "__main__":
    sys.exit(main(convert_flow))
