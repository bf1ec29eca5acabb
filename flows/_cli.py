"""`python -m flows.<stage|pipeline> --config FILE [--store URL] [--run-id ID] [--flag value ...]`.

Runs a flow in this process (ephemeral Prefect API unless PREFECT_API_URL is set), prints its JSON
result, and says where the artifacts are and how to look at the run in the Prefect UI. SIGTERM stops it
cleanly: Prefect marks the runs Crashed, the RL loop stops its engines and Ray, and the process exits
with 143 through the interpreter's normal shutdown (which stops the ephemeral API server). When the
ephemeral API server is gone first (the signal went to the whole process group), Prefect's client stops
retrying it: the process still exits within seconds, 143 (130 for Ctrl-C), the runs' ends unrecorded.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import Flow
from prefect.exceptions import TerminationSignal
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_HOME,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    PREFECT_SERVER_EPHEMERAL_ENABLED,
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    Settings,
    temporary_settings,
)

from flows._stage import resolve_run
from slime.config_reference import ConfigFlagsHelp
from slime.errors import SlimeError
from slime.preflight import HOST_STAGES
from slime.signals import sigterm_as_exit
from slime.storage.lease import check_free

DEFAULT_CONFIG = "deployments/tiny-cpu.yaml"
# Prefect's default (20 s) is too short for its ephemeral API server on a loaded 2-core machine (25-46 s
# measured): `slime pipeline` without make timed out where `make run` (which sets 180 s) did not
EPHEMERAL_STARTUP_TIMEOUT_S = 180


def parse(prog: str, description: str, argv: list[str] | None, takes_model: bool) -> dict[str, Any]:
    """Flow parameters from the command line; unknown `--flag value` pairs become config overrides."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False, add_help=False,
                                     epilog="Any config field can be given as --flag value (slime's flag names).")
    parser.add_argument("-h", "--help", action=ConfigFlagsHelp)  # argparse's help, then every config flag
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


def watch_ephemeral_api(settings: Settings) -> None:
    """Start Prefect's ephemeral API server now (the flow's first API call would) and, once it has exited,
    whatever stopped it, turn off Prefect's client retries in `settings`; nothing with PREFECT_API_URL set.

    `settings` is the run's (from `temporary_settings`): the flow engine's client and the log and event
    workers started under it read PREFECT_CLIENT_MAX_RETRIES from it at every attempt (`_send_with_retry`
    in prefect/client/base.py). Why: SIGTERM or Ctrl-C sent to the process group stops that server with
    the flow, which then retried the Crashed states and logs it reports 5 times each, 2+4+8+16+32 s apart:
    ~150 s to exit, exit code 1. An ephemeral server never comes back; one at PREFECT_API_URL may restart,
    so its retries stay. At a normal exit the server stops after Prefect's workers have flushed."""
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    # imported here, as Prefect does: the server's app takes 1.4 s to import and runs only in ephemeral mode
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # Prefect's one ephemeral server of this process
    server.start()
    process = server.server_process

    def retries_off_once_gone() -> None:
        process.wait()
        settings.client.max_retries = 0

    threading.Thread(target=retries_off_once_gone, name="ephemeral-api-watch", daemon=True).start()


def signal_behind(exc: BaseException) -> int | None:
    """The signal that the chain of exceptions ending in `exc` started from (Prefect's TerminationSignal for
    SIGTERM, KeyboardInterrupt for SIGINT), or None: Prefect reports a signal's Crashed state while handling
    it, so an API error doing that arrives with the signal in its context."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, TerminationSignal):
            return current.signal
        if isinstance(current, KeyboardInterrupt):
            return signal.SIGINT
        pending += [current.__cause__, current.__context__]
    return None


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
        config, _ = resolve_run(params["config"], params["overrides"], params["store"], params["run_id"],
                                needs_device=module not in HOST_STAGES)
        check_free(config, module, watch=bool(config.eval.eval_watch_run))
    except SlimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    startup = max(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(), EPHEMERAL_STARTUP_TIMEOUT_S)
    # as `make run`: no telemetry from the ephemeral API server (its heartbeat logged "database is locked" and
    # "Failed to send telemetry" tracebacks into a plain `slime pipeline`; the machines here have no network)
    updates = {PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: startup, PREFECT_SERVER_ANALYTICS_ENABLED: False}
    with (sigterm_as_exit(),  # SIGTERM still runs every finally and atexit hook (API server, engines, Ray)
          temporary_settings(updates=updates) as settings):
        watch_ephemeral_api(settings)
        try:
            state = flow(**params, return_state=True)
        except Exception as exc:
            signum = signal_behind(exc)
            if signum is None:
                raise
            # the API server went with the signal (sent to the process group): what the stage committed
            # stands, but Prefect could not record the flow runs' ends
            print(f"stopped by {signal.Signals(signum).name}; the Prefect API server was gone, so the flow runs' "
                  f"final states are not recorded ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 128 + signum
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
