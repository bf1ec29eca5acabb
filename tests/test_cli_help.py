"""`--help` of every command that takes config flags: every field flag `slime config reference` lists, with its
type, default and help, one unwrapped line each, printed without importing torch, Ray or Prefect."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slime.cli import main
from slime.config_reference import field_rows, flags_help, reference_markdown

ROOT = Path(__file__).resolve().parents[1]
SLIME = shutil.which("slime", path=str(Path(sys.executable).parent))
# every `slime` command that loads a config (file + --flag value overrides)
CONFIG_COMMANDS = [["convert"], ["sft"], ["export"], ["rejection-sample"], ["evaluate"], ["rl"], ["config", "show"]]
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def reference_flags() -> set[str]:
    """The flags of the field tables of `slime config reference` (docs/configuration.md): their second column."""
    flags = set()
    for line in reference_markdown().splitlines():
        match = re.match(r"\| `[a-z0-9_]+` \| ((?:`--[a-z0-9-]+`(?:, )?)+) \|", line)
        if match:
            flags |= set(re.findall(r"`(--[a-z0-9-]+)`", match.group(1)))
    return flags


def help_flags(text: str) -> set[str]:
    """The flags a `--help` lists as config fields: on each entry line, the spellings before its type and default."""
    section = text[text.index("config flags:"):text.index("pass-through:")]
    return {flag for line in section.splitlines() if line.startswith("  --")
            for flag in FLAG.findall(line.split(", default ")[0])}


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_reference_lists_every_field_and_alias():
    flags = reference_flags()
    assert len(flags) > 270  # the field tables were parsed, not skipped
    assert {"--lora-rank", "--max-policy-version-lag", "--async", "--async-mode", "--no-offload-train"} <= flags
    assert flags == {flag for row in field_rows() for flag in row.flags}


@pytest.mark.parametrize("argv", CONFIG_COMMANDS, ids=" ".join)
def test_help_lists_every_flag_of_the_reference(argv, capsys):
    text = help_of(argv, capsys)
    assert help_flags(text) == reference_flags()
    assert "--config CONFIG" in text  # argparse's own options come first
    assert "--sglang-<flag>" in text and "--router-<flag>" in text  # the pass-through sections are named


def test_stage_scripts_print_the_same_help():
    # `python -m slime.stages.sft --help` hands its arguments to the CLI, as `slime sft` does
    result = subprocess.run([sys.executable, "-m", "slime.stages.sft", "--help"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert help_flags(result.stdout) == reference_flags()


def grep(text: str, flag: str) -> list[str]:
    return [line for line in text.splitlines() if flag in line]


def test_grep_finds_a_flag_with_type_default_and_help():
    result = subprocess.run([SLIME, "rl", "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    (lora,) = grep(result.stdout, "--lora-rank")
    assert re.fullmatch(r"  --lora-rank INT +int, default 0: adapter rank r; 0: LoRA off .*", lora), lora
    (lag,) = grep(result.stdout, "--max-policy-version-lag")
    assert re.fullmatch(r"  --max-policy-version-lag INT +int \| None, default None: fully async: .*", lag), lag
    (offload,) = grep(result.stdout, "--no-offload-train")  # slime's negated spelling, taking no value
    assert offload.startswith("  --offload-train [true|false], --no-offload-train ")
    (async_,) = [line for line in grep(result.stdout, "--async ") if line.startswith("  --async ")]
    assert async_.startswith("  --async {off,one_step_off,fully}, --async-mode {off,one_step_off,fully} ")
    # a field without a description of its own shows slime's help of the same flag
    (nodes,) = grep(result.stdout, "--actor-num-nodes ")
    assert nodes.endswith("int, default 1: Number of nodes for training actor"), nodes


def test_every_field_has_help():
    assert [row.name for row in field_rows() if not row.help] == []


def test_help_imports_no_torch_ray_or_prefect():
    code = ("import sys\nfrom slime.cli import main\ntry:\n    main(['rl', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'prefect', 'megatron', "
            "'transformers'}), file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "[]"
    assert "--lora-rank" in result.stdout


def test_flag_lines_do_not_depend_on_the_terminal_width():
    texts = []
    for columns in ("40", "400"):
        env = {**os.environ, "COLUMNS": columns}
        result = subprocess.run([SLIME, "rl", "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                                env=env)
        assert result.returncode == 0, result.stderr
        texts.append(result.stdout[result.stdout.index("config flags:"):])
    assert texts[0] == texts[1] == flags_help()  # argparse wraps its own part; the flag lines never wrap


def test_help_piped_into_head_exits_quietly():
    result = subprocess.run(f"{SLIME} rl --help | head -1", shell=True, capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.stdout.startswith("usage: slime rl") and "Traceback" not in result.stderr


def test_flow_scripts_list_every_flag():
    # `python -m flows.<stage>` (and `slime pipeline`, which becomes `python -m flows.pipeline`): the flows' parser
    result = subprocess.run([sys.executable, "-m", "flows.rl", "--help"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "--run-id RUN_ID" in result.stdout and "--model MODEL" in result.stdout
    assert help_flags(result.stdout) == reference_flags()
