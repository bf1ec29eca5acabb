"""Flow `rejection_sampling`: sample the run's SFT policy, keep the accepted responses as an SFT shard set.

    python -m flows.rejection_sampling --config deployments/tiny-cpu.yaml [--run-id ID] [--model CKPT]

Without `--model` it samples the run's newest committed `sft` checkpoint (else `convert`); prompts are
`rejection_sampling.rs_prompt_data`, else `data.prompt_data`. Output: `{store}/{run_id}/rejection_sampling/`
(`accepted` and `accepted-candidates` shard sets, both committed). In the pipeline the accepted set is
reported (acceptance statistics, URIs), not trained on: `slime sft --sft-data <accepted URI>` does that.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from flows._cli import DEFAULT_CONFIG, main
from flows._stage import newest_model, resolve_run, run_name, run_stage
from slime.errors import ConfigError
from slime.storage import ArtifactStore
from tasks.rejection_sampling import rejection_sampling

MODEL_STAGES = ("sft", "convert")


@flow(name="rejection_sampling", flow_run_name=run_name("rejection_sampling"))
def rejection_sampling_flow(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None,
                            store: str | None = None, run_id: str | None = None,
                            model: str | None = None) -> dict[str, Any]:
    """Rejection-sample `model` (default: the run's newest SFT checkpoint)."""
    cfg, run_id = resolve_run(config, overrides, store, run_id)
    prompts = cfg.rejection_sampling.rs_prompt_data or cfg.data.prompt_data
    if not prompts:
        raise ConfigError("stage 'rejection_sampling' needs prompts: rejection_sampling.rs_prompt_data "
                          "(--rs-prompt-data) or data.prompt_data (--prompt-data)")
    inputs = {"load": model or newest_model(cfg, run_id, MODEL_STAGES), "prompt_data": prompts}
    output = ArtifactStore.from_config(cfg).uri(run_id, "rejection_sampling")
    return run_stage(rejection_sampling, cfg, run_id, inputs, output)


if __name__ == "__main__":
    sys.exit(main(rejection_sampling_flow, takes_model=True))
