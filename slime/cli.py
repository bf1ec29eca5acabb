"""`slime` command line: one subcommand per library stage, plus store and dataset utilities.

Only commands that work are registered; stages arrive with the issues that build them. Every stage
command takes `--config FILE` followed by `--flag value` overrides with slime's flag names.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable

import yaml

from slime.config import load_config
from slime.config_reference import ConfigFlagsHelp, reference_markdown
from slime.errors import SlimeError
from slime.storage.fs import normalize_uri
from slime.storage.lease import hold_stage

logger = logging.getLogger("slime")


def _config_show(args: argparse.Namespace, overrides: list[str]) -> int:
    """Resolve and validate a config; print it with the hash of every section."""

    config = load_config(args.config, overrides)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    print("# section hashes (cache keys):")
    for section in type(config).model_fields:
        print(f"#   {section}: {config.section_hash(section)[:16]}")
    return 0


def _config_reference(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print the Markdown reference of every config field."""

    print(reference_markdown())
    return 0


def _shards_inspect(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print a shard set's manifest summary, schema, row count and checksum status."""
    from slime.storage import ShardSet

    shard_set = ShardSet.open(normalize_uri(args.uri), json.loads(args.storage_options))
    m = shard_set.manifest
    print(f"shard set     {shard_set.uri}")
    print(f"committed at  {m.created_at} by {m.producer}")
    print(f"format        {m.format}, schema version {m.schema_version}")
    print(f"rows          {m.num_rows} in {len(m.files)} files, {sum(f.bytes for f in m.files)} bytes")
    print(f"config hash   {m.config_hash}")
    if m.metadata:
        print(f"metadata      {json.dumps(m.metadata, sort_keys=True)}")
    problems = shard_set.verify()
    if not problems and m.files:
        print("schema:")
        for field in next(shard_set.iter_tables()).schema:
            print(f"  {field.name}: {field.type}")
    leftovers = shard_set.unreferenced_files()
    if leftovers:
        print(f"unreferenced  {len(leftovers)} files not in the manifest (from failed writers): {leftovers}")
    if problems:
        print("checksums     FAILED")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"checksums     ok ({len(m.files)} files verified)")
    return 0


def _datasets_make_tiny(args: argparse.Namespace, overrides: list[str]) -> int:
    """Build the tiny tokenizer, model and arithmetic data (offline, deterministic)."""
    from slime.data.tiny import load_recipe, make_tiny_kit

    kit = make_tiny_kit(args.out_dir, load_recipe(args.recipe))
    print(f"tiny kit ready in {kit.root}")
    print(f"  model + tokenizer: {kit.model_dir}")
    print(f"  train prompts:     {kit.train}")
    print(f"  eval prompts:      {kit.eval}")
    print(f"  SFT conversations: {kit.sft}")
    return 0


def _stage(run: str, stage: str) -> Callable[[argparse.Namespace, list[str]], int]:
    """A handler that loads the config (file + overrides), prepares the run (kit, outputs under
    {store}/{run_id}, inputs checked: slime.preflight), holds the run's lease, asks the stage's record whether
    it is done with these settings (slime/stages/record.py: reused, resumed, or refused on other settings), runs
    one library stage, records it and prints its result."""

    def handler(args: argparse.Namespace, overrides: list[str]) -> int:
        from slime.preflight import prepare_run
        from slime.stages.definitions import DEFINITIONS, summarize
        from slime.stages.record import begin_stage

        module, function = run.rsplit(".", 1)
        config = prepare_run(load_config(args.config, overrides), stage)
        stage_function = getattr(importlib.import_module(module), function)
        definition = DEFINITIONS.get(stage)  # evaluate: its result directory is named by its settings
        with hold_stage(config, stage, watch=bool(config.eval.eval_watch_run)):
            start = begin_stage(definition, config) if definition is not None else None
            if start is not None and start.reused is not None:
                print(json.dumps({**start.reused, "reused": True, "record": start.record_uri}, indent=1,
                                 sort_keys=True))
                return 0
            started = time.perf_counter()
            result = stage_function(config)
            if start is not None:
                seconds = {stage: round(time.perf_counter() - started, 3)}
                start.finish({**summarize(stage, result, config.run.storage_options), "seconds": seconds})
        print(json.dumps(result, indent=1, sort_keys=True))
        return 0

    return handler


def _engine(args: argparse.Namespace, extra: list[str]) -> int:
    """Run the built-in SGLang-protocol engine server (its own flags: `slime engine --help`)."""
    from slime.engines.builtin.server import main as engine_main

    return engine_main(extra)


def _pipeline(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole Prefect pipeline: `python -m flows.pipeline` in this interpreter's place, so the library
    itself never imports Prefect (flows/ is the orchestration layer); its own flags: `slime pipeline --help`."""
    os.execv(sys.executable, [sys.executable, "-m", "flows.pipeline", *extra])
    return 0  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slime", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    stages = {
        "convert": ("slime.stages.convert.run_convert", "HF checkpoint -> Megatron torch_dist (--hf-checkpoint, --save)"),
        "sft": ("slime.stages.sft.run_sft", "supervised fine-tuning on chat data (--sft-data, --hf-checkpoint, --save)"),
        "export": ("slime.stages.export.run_export", "Megatron checkpoint -> HF safetensors (--load, --output-dir)"),
        "rejection-sample": ("slime.stages.rejection_sampling.run_rejection_sampling", "sample N responses per prompt, "
                             "score them, keep the accepted ones as an SFT shard set (--rs-policy, --rs-reward-threshold, "
                             "--rs-best-of-n)"),
        "evaluate": ("slime.stages.evaluate.run_evaluate", "evaluate a checkpoint on every eval dataset: pass@k, mean "
                     "reward, response length, stored under {run_id}/evaluate/ (--load, --eval-prompt-data or "
                     "--eval-config; --eval-watch-run RUN for its newest checkpoint)"),
        "rl": ("slime.rl.run_rl", "the RL loop on Ray: rollout -> train -> weight sync, periodic eval and "
               "checkpoint; resumes from the newest checkpoint under --save (--num-rollout, --async, "
               "--update-weights-interval, --colocate)"),
    }
    for name, (run, description) in stages.items():
        stage_dir = {"rejection-sample": "rejection_sampling"}.get(name, name)
        stage = commands.add_parser(name, help=description, add_help=False, description=f"{description}. Any "
                                    "config field can be given as --flag value (slime's flag names).")
        stage.add_argument("-h", "--help", action=ConfigFlagsHelp)  # argparse's help, then every config flag
        stage.add_argument("--config", help="YAML config file")
        stage.set_defaults(handler=_stage(run, stage_dir), takes_overrides=True)

    config = commands.add_parser("config", help="inspect configurations").add_subparsers(dest="sub", required=True)
    show = config.add_parser("show", help="print the resolved config and section hashes", add_help=False,
                             description="Extra --flag value arguments override the file, with slime's flag names.")
    show.add_argument("-h", "--help", action=ConfigFlagsHelp)
    show.add_argument("--config", help="YAML config file")
    show.set_defaults(handler=_config_show, takes_overrides=True)
    config.add_parser("reference", help="print the Markdown reference of every field").set_defaults(
        handler=_config_reference)

    shards = commands.add_parser("shards", help="artifact store shard sets").add_subparsers(dest="sub", required=True)
    inspect = shards.add_parser("inspect", help="manifest, schema, row count and checksum status of a shard set")
    inspect.add_argument("uri", help="shard set directory (any fsspec URL)")
    inspect.add_argument("--storage-options", default="{}", help="fsspec options as JSON")
    inspect.set_defaults(handler=_shards_inspect)

    engine = commands.add_parser("engine", add_help=False, help="run the built-in inference engine server "
                                 "(slime engine --model PATH --host 127.0.0.1 --port P)")
    engine.set_defaults(handler=_engine, takes_overrides=True)

    pipeline = commands.add_parser("pipeline", add_help=False, help="the whole pipeline as a Prefect flow: "
                                   "convert -> sft -> rejection_sampling -> rl -> evaluate -> export (slime pipeline "
                                   "--config deployments/tiny-cpu.yaml [--store URL] [--run-id ID] [--flag value])")
    pipeline.set_defaults(handler=_pipeline, takes_overrides=True)

    datasets = commands.add_parser("datasets", help="bundled data sets").add_subparsers(dest="sub", required=True)
    tiny = datasets.add_parser("make-tiny", help="build the tiny model kit (tokenizer, Qwen2 model, task data)")
    tiny.add_argument("out_dir")
    tiny.add_argument("--recipe", help="recipe YAML (default: datasets/tiny/recipe.yaml)")
    tiny.set_defaults(handler=_datasets_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Callable[[argparse.Namespace, list[str]], int] = args.handler
    try:
        return handler(args, extra)
    except SlimeError as exc:
        cause = getattr(exc, "cause", None)  # a Ray task's error wraps the library's own (with a remote traceback)
        print(f"error: {cause if isinstance(cause, SlimeError) else exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
