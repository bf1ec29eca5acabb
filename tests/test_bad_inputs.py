"""A catalogue of bad inputs, one test case each, layer by layer: config file and flags, data files, the
pre-flight of input paths, plugins and rewards, the artifact store, the engine's HTTP API.

Each case asserts the exact exception type, that the message names what is wrong (file and line, config
field, flag, path), and, through two autouse fixtures, that no process started by the case is left
running and that the shard set committed before the module's first case still reads back intact.
Command-line cases also run `slime ...` in-process and check it prints `error: <the message>`, no
traceback, and exits 2. Everything here fails before Ray or Megatron start, except the architecture case (one
subprocess) and the engine cases (one built-in engine for the module).
"""

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import httpx
import psutil
import pytest

from slime.backends.megatron.checkpoint import CheckpointMismatchError
from slime.config import load_config
from slime.data.prompts import load_prompts
from slime.data.sft import load_sft_samples
from slime.errors import (
    ConfigError,
    CorruptArtifactError,
    DataFormatError,
    EngineHTTPError,
    InputNotFoundError,
    NotCommittedError,
    StorageWriteError,
)
from slime.plugins import PluginError
from slime.preflight import prepare_run
from slime.rollout.rewards import compute_reward
from slime.storage import ArtifactStore, read_samples, write_samples
from slime.storage.manifest import verify_files
from slime.types import Sample

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """A shard set committed before every case of the module: it must read back intact after each."""
    store = tmp_path_factory.mktemp("store")
    uri = ArtifactStore(str(store)).uri("cat", "rollout", "000000")
    samples = [Sample(index=i, group_index=i, prompt=f"{i}+1=", tokens=[1, 2, 3], response="x",
                      response_length=1, reward=float(i), loss_mask=[1]) for i in range(8)]
    write_samples(uri, samples, target_file_bytes=1_000)
    return store, uri, samples


@pytest.fixture(autouse=True)
def nothing_committed_is_lost(committed):
    yield
    _, uri, samples = committed
    from slime.storage import read_manifest

    assert verify_files(uri, read_manifest(uri)) == [] and read_samples(uri) == samples


@pytest.fixture(autouse=True)
def no_process_left_behind():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"left running: {[(p.pid, p.cmdline()[:4]) for p in left]}"


@pytest.fixture(scope="module")
def base_yaml(tiny_kit, committed):
    """A valid config for `slime rl` on the tiny kit (absolute paths); cases edit a copy of it."""
    store, _, _ = committed
    return textwrap.dedent(f"""\
        run:
          store: {store}
          run_id: cat
        checkpoint:
          hf_checkpoint: {tiny_kit.model_dir}
        data:
          prompt_data: {tiny_kit.train}
          apply_chat_template: true
        rollout:
          rollout_batch_size: 2
          n_samples_per_prompt: 2
          num_rollout: 1
          rollout_max_response_len: 4
        train:
          global_batch_size: 4
          micro_batch_size: 2
        eval:
          eval_prompt_data:
            arith: {tiny_kit.eval}
        """)


@pytest.fixture
def config_file(tmp_path, base_yaml):
    """`config_file(replace={old: new}, extra="yaml text")`: the base config, edited, as a file."""

    def make(replace: dict[str, str] | None = None, extra: str = "", name: str = "c.yaml") -> Path:
        text = base_yaml
        for old, new in (replace or {}).items():
            assert old in text
            text = text.replace(old, new)
        path = tmp_path / name
        path.write_text(text + extra)
        return path

    return make


def fails(exc_type: type[BaseException], *fragments: str):
    """`with fails(Type, "names", ...)`: raises exactly `Type` with every fragment in its message."""
    return _Fails(exc_type, fragments)


class _Fails:
    def __init__(self, exc_type, fragments):
        self.exc_type, self.fragments = exc_type, fragments

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        assert exc is not None, f"expected {self.exc_type.__name__}, nothing was raised"
        assert type(exc) is self.exc_type, f"expected {self.exc_type.__name__}, got {type(exc).__name__}: {exc}"
        for fragment in self.fragments:
            assert fragment in str(exc), f"{fragment!r} not in {str(exc)!r}"
        self.message = str(exc)
        return True


def cli_fails(capsys, argv: list[str], exc_type: type[BaseException], *fragments: str) -> str:
    """`slime ARGV` raises `exc_type` naming `fragments`; the command prints just that message, exit 2."""
    from slime.cli import build_parser, main

    args, extra = build_parser().parse_known_args(argv)
    with fails(exc_type, *fragments) as failure:
        args.handler(args, extra)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {failure.message}" and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- config file and flags


def test_unknown_field_names_file_line_and_the_closest_field(capsys, config_file):
    path = config_file({"  n_samples_per_prompt: 2": "  n_sample_per_prompt: 2"})
    cli_fails(capsys, ["config", "show", "--config", str(path)], ConfigError,
              f"{path}:11", "unknown field 'rollout.n_sample_per_prompt'", "did you mean 'n_samples_per_prompt'")


def test_mistyped_field_value_names_file_line_and_value(capsys, config_file):
    path = config_file({"rollout_batch_size: 2": "rollout_batch_size: two"})
    cli_fails(capsys, ["config", "show", "--config", str(path)], ConfigError,
              f"{path}:10", "rollout.rollout_batch_size", "'two'")


def test_field_in_the_wrong_section_says_where_it_belongs(capsys, config_file):
    path = config_file({"  micro_batch_size: 2": "  micro_batch_size: 2\n  num_rollout: 3"})
    cli_fails(capsys, ["config", "show", "--config", str(path)], ConfigError,
              f"{path}:17", "unknown field 'train.num_rollout'", "it belongs under 'rollout:'")


def test_unknown_section(capsys, config_file):
    path = config_file(extra="rollouts:\n  num_rollout: 1\n")
    cli_fails(capsys, ["config", "show", "--config", str(path)], ConfigError, "unknown section 'rollouts'",
              "did you mean 'rollout'")


def test_invalid_yaml_names_the_line(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  store: [unclosed\n")
    cli_fails(capsys, ["config", "show", "--config", str(path)], ConfigError, f"{path}: invalid YAML", "line 3")


def test_missing_config_file(capsys, tmp_path):
    cli_fails(capsys, ["rl", "--config", str(tmp_path / "nope.yaml")], ConfigError,
              f"config file {tmp_path / 'nope.yaml'} does not exist")


@pytest.mark.parametrize(("flags", "fragments"), [
    (["--rollout-batch-size", "-1"], ["--rollout-batch-size: rollout.rollout_batch_size",
                                      "greater than or equal to 1", "'-1'"]),
    (["--global-batch-size", "0"], ["--global-batch-size: train.global_batch_size", "greater than or equal to 1"]),
    (["--micro-batch-size", "0"], ["--micro-batch-size: train.micro_batch_size", "greater than or equal to 1"]),
    (["--n-samples-per-prompt", "3"], ["train.global_batch_size", "2 * 3 = 6 must be a multiple of "
                                       "global_batch_size (4)", "rollout.n_samples_per_prompt set at --n-samples"]),
    (["--micro-batch-size", "3"], ["train.micro_batch_size", "global_batch_size 4 is not a multiple of "
                                   "micro_batch_size 3"]),
    (["--rollout-batch-size"], ["--rollout-batch-size: missing value"]),
    (["--rollout-batch-sise", "8"], ["--rollout-batch-sise", "unknown option", "did you mean 'rollout-batch-size'"]),
    (["--sglang-mem-fraction-statik", "0.5"], ["--sglang-mem-fraction-statik is not a flag of SGLang", "did you mean --sglang-mem-fraction-static?"]),
    (["--run-id", "../other"], ["--run-id: run.run_id", "must be one directory name", "no '/' or '..'"]),
    (["--run-id", "a/b"], ["--run-id: run.run_id", "'a/b'", "must be one directory name"]),
    (["--store", "foo://x"], ["--store: run.store: unknown storage protocol 'foo'"]),
], ids=["negative-batch", "zero-global-batch", "zero-micro-batch", "indivisible-rollout-batch",
        "indivisible-micro-batch", "flag-without-value", "unknown-flag", "unknown-sglang-flag", "run-id-dotdot",
        "run-id-slash", "unknown-store-protocol"])
def test_bad_flag_names_the_flag(capsys, config_file, flags, fragments):
    cli_fails(capsys, ["rl", "--config", str(config_file()), *flags], ConfigError, *fragments)


# ----------------------------------------------------------------------------- data files


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": \n')
    with fails(DataFormatError, f"{path}:2: invalid JSON"):
        load_prompts(path)


def test_missing_prompt_key_names_line_and_keys_present(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"question": "1+1=", "label": "2"}\n')
    with fails(DataFormatError, f"{path}:1: missing field 'prompt' (input_key)", "['label', 'question']"):
        load_prompts(path)


def test_missing_label_key(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "1+1=", "label": "2"}\n{"prompt": "1+2="}\n')
    with fails(DataFormatError, f"{path}:2: missing field 'label' (label_key)"):
        load_prompts(path)


def test_missing_messages_key_in_sft_data(tmp_path, tiny_kit):
    from transformers import AutoTokenizer

    path = write(tmp_path, "sft.jsonl", '{"conversation": [{"role": "user", "content": "hi"}]}\n')
    with fails(DataFormatError, f"{path}:1", "'messages' (messages_key)"):
        load_sft_samples(path, AutoTokenizer.from_pretrained(tiny_kit.model_dir))


def test_empty_dataset(tmp_path):
    path = write(tmp_path, "empty.jsonl", "")
    with fails(DataFormatError, f"{path}: the file (and slice, if any) yielded no records"):
        load_prompts(path)


def test_slicing_past_the_end(tiny_kit):
    path = f"{tiny_kit.train}@[5000:6000]"
    with fails(DataFormatError, f"{path}: the file (and slice, if any) yielded no records"):
        load_prompts(path)


def test_bad_slice_syntax_names_the_field(config_file, tiny_kit):
    config = load_config(config_file(), ["--prompt-data", f"{tiny_kit.train}@[a:b]"])
    with fails(ConfigError, "data.prompt_data (set at --prompt-data)", "bad row slice '@[a:b]'"):
        prepare_run(config, "rl")


def test_chat_template_requested_from_a_tokenizer_without_one(tmp_path, tiny_kit):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_kit.model_dir)
    tokenizer.chat_template = None
    with fails(ConfigError, "data.apply_chat_template (--apply-chat-template)", str(tiny_kit.model_dir),
               "has no chat template"):
        load_prompts(str(tiny_kit.train), tokenizer=tokenizer, apply_chat_template=True)


# ----------------------------------------------------------------------------- pre-flight of input paths


def test_missing_hf_checkpoint_names_field_line_and_path(capsys, config_file, tmp_path):
    path = config_file({"hf_checkpoint: ": "hf_checkpoint: models/nope  # "})
    cli_fails(capsys, ["rl", "--config", str(path)], InputNotFoundError,
              f"checkpoint.hf_checkpoint (set at {path}:5): {tmp_path / 'models' / 'nope'} does not exist",
              "huggingface-cli download", "resolve against the file's directory")


def test_hf_checkpoint_without_a_tokenizer(capsys, config_file, tiny_kit, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((tiny_kit.model_dir / "config.json").read_text())
    cli_fails(capsys, ["rl", "--config", str(config_file()), "--hf-checkpoint", str(model)], InputNotFoundError,
              f"checkpoint.hf_checkpoint (set at --hf-checkpoint): {model} has no tokenizer")


def test_hf_checkpoint_that_is_not_a_model_directory(capsys, config_file, tmp_path):
    cli_fails(capsys, ["rl", "--config", str(config_file()), "--hf-checkpoint", str(tmp_path)], InputNotFoundError,
              f"{tmp_path} is not an HF model directory (no config.json in it)")


def test_missing_prompt_file(capsys, config_file, tiny_kit):
    path = config_file({"prompt_data: ": "prompt_data: /nonexistent/train.jsonl  # "})
    cli_fails(capsys, ["rl", "--config", str(path)], InputNotFoundError,
              f"data.prompt_data (set at {path}:7): /nonexistent/train.jsonl does not exist")


def test_missing_prompt_file_through_slime_pipeline_stops_before_prefect(config_file, tmp_path):
    """The pipeline (a Prefect flow in `python -m flows.pipeline`) checks the config before Prefect starts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
           "PREFECT_HOME": str(tmp_path / "prefect-home")}
    done = subprocess.run([sys.executable, "-m", "slime", "pipeline", "--config", str(config_file()),
                           "--prompt-data", "nope.jsonl"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: data.prompt_data (set at --prompt-data): nope.jsonl does not exist; relative paths on the "
        "command line resolve against the working directory")
    assert not list((tmp_path / "prefect-home").iterdir())  # no API server started: no database, no logs


def test_input_url_of_an_unknown_protocol(capsys, config_file):
    cli_fails(capsys, ["rl", "--config", str(config_file()), "--prompt-data", "hdfss://data/train.jsonl"],
              ConfigError, "data.prompt_data (set at --prompt-data): unknown storage protocol 'hdfss'")


def test_shards_inspect_of_an_unknown_protocol(capsys):
    cli_fails(capsys, ["shards", "inspect", "foo://bucket/set"], ConfigError,
              "foo://bucket/set/manifest.json: unknown storage protocol 'foo'")


def test_engine_started_on_a_missing_model(capsys, tmp_path):
    from slime.cli import main

    assert main(["engine", "--model", str(tmp_path / "nope"), "--port", "1"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --model {tmp_path / 'nope'}: not a local HF model "
                                               "directory (no config.json in it)")


def test_second_writer_of_a_run_through_a_flow_command_stops_before_prefect(config_file, committed, tmp_path):
    """`python -m flows.convert` on a run another process writes: refused at once, naming that process."""
    store, _, _ = committed
    now = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    lease = store / "cat" / ".lease.json"
    lease.write_text(json.dumps({"host": "gpu-node-7", "pid": 4242, "since": now, "renewed_at": now, "token": "t",
                                 "command": "slime pipeline --config x.yaml"}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
           "PREFECT_HOME": str(tmp_path / "prefect-home")}
    try:
        done = subprocess.run([sys.executable, "-m", "flows.convert", "--config", str(config_file())], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
    finally:
        lease.unlink()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: run {store / 'cat'} is in use by slime pipeline --config x.yaml (host "
                           f"gpu-node-7, pid 4242, since {now}): one writer per run"), last
    assert not list((tmp_path / "prefect-home").iterdir())  # Prefect never started


def test_missing_eval_file(capsys, config_file):
    cli_fails(capsys, ["rl", "--config", str(config_file()), "--eval-prompt-data", "held", "missing.jsonl@[0:4]"],
              InputNotFoundError, "eval.eval_prompt_data.held (set at --eval-prompt-data): missing.jsonl does not "
              "exist", "relative paths on the command line resolve against the working directory")


def test_missing_checkpoint_dir(capsys, config_file, tmp_path):
    cli_fails(capsys, ["export", "--config", str(config_file()), "--load", str(tmp_path / "ckpt")],
              InputNotFoundError, f"checkpoint.load (set at --load): {tmp_path / 'ckpt'} does not exist")


def test_kit_recipe_without_kit_dir(capsys, config_file):
    path = config_file(extra="kit:\n  kit_recipe: recipe.yaml\n")
    cli_fails(capsys, ["rl", "--config", str(path)], ConfigError, f"kit.kit_recipe (set at {path}:",
              "needs kit.kit_dir too")


def test_kit_recipe_with_an_unknown_field_names_recipe_and_field(capsys, config_file, tmp_path):
    (tmp_path / "recipe.yaml").write_text("seed: 1\nmodel:\n  hidden_sise: 64\n")
    path = config_file(extra="kit:\n  kit_recipe: recipe.yaml\n  kit_dir: kit\n")
    cli_fails(capsys, ["rl", "--config", str(path)], ConfigError,
              f"{tmp_path / 'recipe.yaml'}: invalid tiny-kit recipe: field 'model.hidden_sise'")
    assert not (tmp_path / "kit").exists()


def test_kit_dir_holding_something_else(capsys, config_file, tmp_path):
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "notes.txt").write_text("mine")
    path = config_file(extra=f"kit:\n  kit_recipe: {ROOT / 'tests' / 'tiny_kit_recipe.yaml'}\n  kit_dir: kit\n")
    cli_fails(capsys, ["rl", "--config", str(path)], ConfigError,
              f"{tmp_path / 'kit'} exists but holds no complete tiny kit")
    assert (tmp_path / "kit" / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- plugins and rewards


def test_plugin_path_that_does_not_import(capsys, config_file):
    cli_fails(capsys, ["rl", "--config", str(config_file()), "--custom-rm-path", "no_such_module.reward"],
              PluginError, "plugin 'no_such_module.reward': cannot import module 'no_such_module'",
              "ModuleNotFoundError")


def test_plugin_that_is_not_callable(capsys, config_file, make_module):
    module = make_module("THRESHOLD = 3\n")
    cli_fails(capsys, ["rl", "--config", str(config_file()), "--custom-rm-path", f"{module}.THRESHOLD"],
              PluginError, f"plugin '{module}.THRESHOLD' is a int, not a function")


def test_plugin_with_the_wrong_signature(capsys, config_file, make_module):
    module = make_module("async def rm(sample):\n    return 1.0\n")
    cli_fails(capsys, ["rl", "--config", str(config_file()), "--custom-rm-path", f"{module}.rm"],
              PluginError, f"plugin '{module}.rm' has signature (sample) but is called as fn(args, sample)")


def test_rollout_hook_with_the_wrong_signature_names_the_field(capsys, config_file, make_module):
    module = make_module("def keep(args):\n    return True\n")
    cli_fails(capsys, ["rl", "--config", str(config_file()), "--dynamic-sampling-filter-path", f"{module}.keep"],
              PluginError, "dynamic_sampling_filter_path (--dynamic-sampling-filter-path)", f"{module}.keep")


@pytest.mark.parametrize(("returned", "fragment"), [("float('nan')", "returned NaN"),
                                                    ("None", "returned NoneType None"),
                                                    ("'1.0'", "returned str '1.0'")],
                         ids=["nan", "none", "string"])
def test_reward_returning_a_non_number(make_module, returned, fragment):
    module = make_module(f"async def rm(args, sample):\n    return {returned}\n")
    args = load_config(None, ["--custom-rm-path", f"{module}.rm"]).as_namespace()
    sample = Sample(prompt="1+1=", response="2", label="2")
    with fails(DataFormatError, f"{module}.rm {fragment}"):
        asyncio.run(compute_reward(args, sample))
    assert sample.reward is None


def test_an_error_raised_in_a_ray_actor_prints_as_the_librarys_own(capsys, config_file, monkeypatch):
    """An empty dataset found by the rollout manager (a Ray actor) reaches the command as Ray's RayTaskError,
    whose text is the remote traceback: the command prints the library's own one-line message."""
    import ray.exceptions

    import slime.rl

    cause = DataFormatError("train.jsonl: the file (and slice, if any) yielded no records")
    remote = ray.exceptions.RayTaskError("RolloutManager.start", "Traceback (most recent call last): ...",
                                         cause).as_instanceof_cause()

    def run_rl(config):
        raise remote

    monkeypatch.setattr(slime.rl, "run_rl", run_rl)
    from slime.cli import main

    assert isinstance(remote, DataFormatError)  # what the CLI catches; its text is Ray's, not the message
    assert main(["rl", "--config", str(config_file())]) == 2
    assert capsys.readouterr().err.strip() == f"error: {cause}"


# ----------------------------------------------------------------------------- artifact store


def test_corrupt_arrow_part_names_the_file(tmp_path):
    uri = str(tmp_path / "set")
    write_samples(uri, [Sample(index=i, prompt="p", tokens=[i] * 50) for i in range(20)], target_file_bytes=500)
    part = sorted(p for p in Path(uri).iterdir() if p.name.startswith("part-"))[1]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    with fails(CorruptArtifactError, part.name):
        read_samples(uri)


def test_truncated_manifest(tmp_path):
    uri = str(tmp_path / "set")
    write_samples(uri, [Sample(index=0, prompt="p")])
    manifest = Path(uri) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    with fails(CorruptArtifactError, f"{manifest}: unreadable manifest"):
        read_samples(uri)


def test_missing_manifest(tmp_path):
    uri = str(tmp_path / "set")
    write_samples(uri, [Sample(index=0, prompt="p")])
    (Path(uri) / "manifest.json").unlink()
    with fails(NotCommittedError, f"{uri} is not a committed artifact: manifest.json is missing"):
        read_samples(uri)


def test_disk_full_while_writing_a_shard(committed, monkeypatch):
    store, _, _ = committed
    uri = ArtifactStore(str(store)).uri("cat", "rollout", "000001")
    local = fsspec.filesystem("file")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(local), "pipe_file", full)
    with fails(StorageWriteError, f"{uri}/part-", "No space left on device", "was not committed"):
        write_samples(uri, [Sample(index=0, prompt="p")])
    monkeypatch.undo()
    with fails(NotCommittedError, uri):
        read_samples(uri)


def test_sigterm_during_a_commit_leaves_no_partial_set(committed, tmp_path):
    """A writer killed (SIGTERM) while its commit uploads parts: exit 143, nothing visible, no part left."""
    store, _, _ = committed
    uri = ArtifactStore(str(store)).uri("cat", "rollout", "000002")
    ready = tmp_path / "uploading"
    script = textwrap.dedent(f"""
        import time
        import fsspec
        from slime.signals import sigterm_as_exit
        from slime.storage import write_samples
        from slime.types import Sample
        fs = type(fsspec.filesystem("file"))
        real = fs.pipe_file
        def slow(self, path, *args, **kwargs):
            open({str(ready)!r}, "w").close()
            time.sleep(3)
            return real(self, path, *args, **kwargs)
        fs.pipe_file = slow
        with sigterm_as_exit():
            write_samples({uri!r}, [Sample(index=i, prompt="p", tokens=[i] * 50) for i in range(50)])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    process = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143
    with fails(NotCommittedError, uri):
        read_samples(uri)
    assert not list(Path(uri).glob("part-*"))  # the aborted writer removed its parts


def test_checkpoint_of_another_architecture(tiny_kit, tmp_path):
    """Export a converted checkpoint with an origin HF config of another MLP width (one subprocess: Megatron)."""
    origin = tmp_path / "origin"
    origin.mkdir()
    for file in tiny_kit.model_dir.iterdir():
        (origin / file.name).write_bytes(file.read_bytes())
    hf_config = json.loads((origin / "config.json").read_text())
    hf_config["intermediate_size"] //= 2
    (origin / "config.json").write_text(json.dumps(hf_config))
    script = textwrap.dedent(f"""
        from slime.config import load_config
        from slime.stages.convert import run_convert
        from slime.stages.export import run_export
        run_convert(load_config(None, ["--hf-checkpoint", {str(tiny_kit.model_dir)!r}, "--save", {str(tmp_path / "c")!r}]))
        try:
            run_export(load_config(None, ["--load", {str(tmp_path / "c")!r}, "--origin-hf-dir", {str(origin)!r},
                                          "--output-dir", {str(tmp_path / "hf")!r}]))
        except Exception as exc:
            print("RAISED", type(exc).__module__, type(exc).__name__, str(exc).splitlines()[0])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    raised = [line for line in done.stdout.splitlines() if line.startswith("RAISED")]
    assert raised, done.stdout[-2000:] + done.stderr[-2000:]
    name = f"{CheckpointMismatchError.__module__} {CheckpointMismatchError.__name__}"
    assert raised[0].startswith(f"RAISED {name} {tmp_path / 'c'}/iter_0000000: ffn_hidden_size is "
                                f"{hf_config['intermediate_size'] * 2} in the checkpoint but "
                                f"{hf_config['intermediate_size']} in the model loading it"), raised[0]
    assert not (tmp_path / "hf" / "manifest.json").exists()


# ----------------------------------------------------------------------------- engine HTTP API


@pytest.fixture(scope="module")
def engine(tiny_kit, tmp_path_factory):
    from slime.engines.builtin.launcher import start_builtin_engine

    process, url = start_builtin_engine(str(tiny_kit.model_dir), log_path=tmp_path_factory.mktemp("e") / "e.log")
    try:
        yield url
    finally:
        process.stop()
    assert not process.alive


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=120, trust_env=False) as client:
        yield client


@pytest.mark.parametrize(("body", "fragment"), [
    (b"{garbage", "not valid JSON"),
    (b'{"input_ids": []}', "input is empty"),
    (b'{"text": ""}', "input is empty"),
    (b'{"input_ids": [1], "return_everything": true}', "field 'return_everything'=True is not supported"),
    (b'{"input_ids": [1], "sampling_params": {"temperatur": 0.5}}', "unknown sampling_params field 'temperatur'"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": -0.5}}', "sampling_params.temperature=-0.5: must be "
                                                                       ">= 0"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1000000000}}', "exceeds the model's maximum "
                                                                                "context length of 512 tokens"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 7}}', "sampling_params.top_p=7: must be in (0, 1]"),
    (b'{"input_ids": [100000]}', "input_ids holds [100000] outside the vocabulary"),
], ids=["garbage-json", "empty-input-ids", "empty-text", "unknown-field", "unknown-sampling-field",
        "negative-temperature", "huge-max-new-tokens", "top-p-out-of-range", "out-of-vocabulary-id"])
def test_engine_answers_a_bad_request_with_400_and_stays_healthy(engine, http, body, fragment):
    response = http.post(f"{engine}/generate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text
    ok = http.post(f"{engine}/generate", json={"input_ids": [49], "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 1


def test_stop_string_longer_than_the_context_is_accepted_and_never_matches(engine, http):
    """SGLang's behaviour: a stop string is not validated against the context; generation ends at its length."""
    body = {"input_ids": [49], "sampling_params": {"max_new_tokens": 3, "stop": ["9" * 5000], "temperature": 0}}
    response = http.post(f"{engine}/generate", json=body)
    assert response.status_code == 200 and response.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert http.get(f"{engine}/health").status_code == 200


def test_unreachable_engine_names_the_url():
    from slime.engines.client import EngineClient

    with psutil_free_port() as port:
        url = f"http://127.0.0.1:{port}/generate"

    async def call():
        async with EngineClient(max_retries=1, backoff_base_s=0.01, connect_timeout_s=2) as client:
            return await client.post(url, {"input_ids": [1]})

    with fails(EngineHTTPError, url) as failure:
        asyncio.run(call())
    assert "POST" in failure.message


class psutil_free_port:
    """A port nothing listens on: bound, then released (the OS does not hand it out again at once)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()
