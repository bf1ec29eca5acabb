"""Flow `export`: a Megatron checkpoint of the run -> an HF safetensors directory in `{store}/{run_id}/export/`.

    python -m flows.export --config deployments/tiny-cpu.yaml [--run-id ID] [--model CKPT] [--origin-hf-dir DIR]

Without `--model` it exports the run's newest committed checkpoint of the latest model stage.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from flows._cli import DEFAULT_CONFIG, main
from flows._stage import newest_model, output_uri, resolve_run, run_name, run_stage
from tasks.export import OUTPUT_NAME, export

# stages whose checkpoints export takes when run alone, latest first
MODEL_STAGES = ("rl", "sft", "convert")


@flow(name="export", flow_run_name=run_name("export"))
def export_flow(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, store: str | None = None,
                run_id: str | None = None, model: str | None = None) -> dict[str, Any]:
    """Export `model` (default: the run's newest model checkpoint) as an HF directory."""
    cfg, run_id = resolve_run(config, overrides, store, run_id, needs_device=False)
    inputs = {"load": model or newest_model(cfg, run_id, MODEL_STAGES)}
    if cfg.export.origin_hf_dir:
        inputs["origin_hf_dir"] = cfg.export.origin_hf_dir
    return run_stage(export, cfg, run_id, inputs, output_uri(cfg, run_id, "export", OUTPUT_NAME))


if __name__ == "__main__":
    sys.exit(main(export_flow, takes_model=True))
