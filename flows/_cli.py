"""`python -m flows.<stage|pipeline> --config FILE [--store URL] [--run-id ID] [--flag value ...]`.

Runs a flow in this process (ephemeral Prefect API unless PREFECT_API_URL is set), prints its JSON
result, and says where the artifacts are and how to look at the run in the Prefect UI. SIGTERM stops it
cleanly: Prefect marks the runs Crashed, the RL loop stops its engines and Ray, and the process exits
with 143 through the interpreter's normal shutdown (which stops the ephemeral API server).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import Flow
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_HOME,
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    temporary_settings,
)

from flows._stage import resolve_run
from slime.errors import SlimeError
from slime.signals import sigterm_as_exit
from slime.storage.lease import check_free

DEFAULT_CONFIG = "deployments/tiny-cpu.yaml"
# Prefect's default (20 s) is too short for its ephemeral API server on a loaded 2-core machine (25-46 s
# measured): `slime pipeline` without make timed out where `make run` (which sets 180 s) did not
EPHEMERAL_STARTUP_TIMEOUT_S = 180


def parse(prog: str, description: str, argv: list[str] | None, takes_model: bool) -> dict[str, Any]:
    """Flow parameters from the command line; unknown `--flag value` pairs become config overrides."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                     epilog="Any config field can be given as --flag value (slime's flag names).")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
    parser.add_argument("--store", help="artifact store root (default: run.store of the config)")
    parser.add_argument("--run-id", help="run directory under the store; reuse it to resume (default: run.run_id)")
    if takes_model:
        parser.add_argument("--model", help="checkpoint to start from (default: the run's newest upstream one)")
    args, overrides = parser.parse_known_args(argv)
    params = {"config": args.config, "overrides": overrides, "store": args.store, "run_id": args.run_id}
    if takes_model:
        params["model"] = args.model
    return params


def ui_hint(flow_run_id: str | None = None) -> str:
    """How to see this run (its flow run page when the id is known) in the Prefect UI."""
    page = f"runs/flow-run/{flow_run_id}" if flow_run_id else "runs"
    api = PREFECT_API_URL.value()
    if api:
        return f"Prefect UI for this run: {api.removesuffix('/api')}/{page}"
    home = PREFECT_HOME.value()
    return (f"Prefect UI for this run: PREFECT_HOME={home} .venv/bin/prefect server start --host 127.0.0.1 "
            f"--port 4200, then open http://127.0.0.1:4200/{page}")


def main(flow: Flow, argv: list[str] | None = None, takes_model: bool = False,
         describe: Callable[[Any], str] | None = None) -> int:
    """Run `flow` with parameters from `argv`; print its JSON result, or `describe(result)` when given (the
    JSON then only with --json); 2 on a slime error."""
    for name in ("slime", "tasks"):  # their INFO lines (checkpoint commits, SFT losses) belong in the run log
        logging.getLogger(name).setLevel(logging.INFO)
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = describe is None or "--json" in argv
    argv = [a for a in argv if a != "--json"]
    module = Path(inspect.getfile(flow.fn)).stem  # not __module__: that is "__main__" under python -m
    params = parse(f"python -m flows.{module}", flow.description or flow.name, argv,
                   takes_model)
    try:  # the config, its kit, its input paths and the run's lease, before Prefect and its API server start
        config, _ = resolve_run(params["config"], params["overrides"], params["store"], params["run_id"])
        check_free(config, module, watch=bool(config.eval.eval_watch_run))
    except SlimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    startup = max(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(), EPHEMERAL_STARTUP_TIMEOUT_S)
    with (sigterm_as_exit(),  # SIGTERM still runs every finally and atexit hook (API server, engines, Ray)
          temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: startup})):
        state = flow(**params, return_state=True)
    flow_run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
    try:
        result = state.result()  # the flow's own exception, re-raised
    except SlimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        print(ui_hint(flow_run_id), file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(result, indent=1, sort_keys=True))
    if describe is not None:
        print(describe(result))
    print(ui_hint(flow_run_id))
    return 0
