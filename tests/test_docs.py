"""The docs as a newcomer reads them: links resolve, commands name real entry points and flags, figures are current.

* every relative link in README.md and docs/*.md names a file that exists, and its `#anchor` a heading of that file
  (GitHub's anchor rules);
* every command in a ```bash block of README.md and docs/from-slime.md names a real entry point: `make` targets and
  variables of the Makefile, `slime <sub>` subcommands, `python -m` modules, and their `--flags`, parsed by the
  real parsers (`slime.cli.build_parser`, `flows._cli.parse`, the built-in engine's parser) and `load_config`
  (nothing runs: no kit, no Ray, no engine);
* each line of the README's figures section links to docs/benchmarks.md and every number on it is there;
* docs/README.md lists every doc;
* the refused-flag table of docs/from-slime.md is the refused rows `slime config reference` prints
  (`make docs` rewrites it, with docs/configuration.md).

`python tests/test_docs.py --write` rewrites the generated table of docs/from-slime.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from slime.cli import build_parser
from slime.config import load_config
from slime.config_reference import reference_markdown
from slime.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED = [ROOT / "README.md", *DOCS]
COMMANDS_CHECKED = [ROOT / "README.md", ROOT / "docs" / "from-slime.md"]
README_MAX_LINES = 160

# --- Markdown -----------------------------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans kept (links may sit in them)."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def fenced_blocks(text: str, language: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every ```<language> block."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if current is None and re.match(rf"^\s*```{language}\s*$", line):
            current, start = [], number + 1
        elif current is not None and FENCE.match(line):
            blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, punctuation but `-` and `_` removed, spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in `path`; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        if match := HEADING.match(line):
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def link_problems(path: Path) -> list[str]:
    problems = []
    for number, line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            where = f"{path.relative_to(ROOT)}:{number}: ({target})"
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{where}: {file_part} does not exist")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{where}: no heading with anchor #{anchor} in {linked.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("path", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert not link_problems(path), "\n".join(link_problems(path))


def test_slug_follows_githubs_rules():
    assert slug("The embedded default learns (`bench/learning.py`)") == "the-embedded-default-learns-benchlearningpy"
    assert slug("Fully async (`--async-mode fully`)") == "fully-async---async-mode-fully"
    assert slug("On your GPUs") == "on-your-gpus"


# --- commands -----------------------------------------------------------------------------------------------------

OPERATORS = {"&&", "||", "|", ";", "&"}
REDIRECT = re.compile(r"^\d?>>?(&\d)?$|^<$")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
ARRAY_START = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)=\(\s*(#.*)?$")
ARRAY_USE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\[@\]\}$")
PIPE_TARGETS = {"grep", "tee", "head", "tail", "less"}


def shell_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(where, argv) of every simple command in the ```bash blocks of `path`: `\\` continuations joined,
    comments dropped, bash arrays (`NAME=( ... )`, used as "${NAME[@]}") expanded, pipes and && split."""
    arrays: dict[str, list[str]] = {}
    commands = []
    for start, block in fenced_blocks(path.read_text(), "bash"):
        lines: list[tuple[int, str]] = []
        for offset, line in enumerate(block):
            if lines and lines[-1][1].endswith("\\"):
                lines[-1] = (lines[-1][0], lines[-1][1][:-1] + " " + line)
            else:
                lines.append((start + offset, line))
        array: str | None = None
        for number, line in lines:
            where = f"{path.relative_to(ROOT)}:{number}"
            if array is not None:
                if line.strip() == ")":
                    array = None
                else:
                    arrays[array] += shlex.split(line, comments=True)
                continue
            if match := ARRAY_START.match(line):
                array = match.group(1)
                arrays[array] = []
                continue
            tokens = []
            for token in shlex.split(line, comments=True):
                use = ARRAY_USE.match(token)
                tokens += arrays[use.group(1)] if use else [token]
            segment: list[str] = []
            skip_next = False
            for token in [*tokens, ";"]:
                if skip_next:
                    skip_next = False
                elif token in OPERATORS:
                    if segment:
                        commands.append((where, segment))
                    segment = []
                elif REDIRECT.match(token):
                    skip_next = token in (">", ">>", "<")
                else:
                    segment.append(token)
    return commands


def makefile_names() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*[?:]?=", text, re.M))
    return targets, variables


def check_make(argv: list[str]) -> None:
    targets, variables = makefile_names()
    for arg in argv:
        if "=" in arg:
            assert arg.split("=", 1)[0] in variables, f"make: no variable {arg.split('=', 1)[0]} in the Makefile"
        else:
            assert arg in targets, f"make: no target {arg!r} in the Makefile (targets: {sorted(targets)})"


def check_config(config: str | None, overrides: list[str]) -> None:
    """The flags a stage command passes on to the config: load_config validates them (nothing starts)."""
    load_config(config, overrides)


def parse_or_fail(parser: argparse.ArgumentParser, argv: list[str], known: bool = False):
    try:
        return parser.parse_known_args(argv) if known else (parser.parse_args(argv), [])
    except SystemExit as exc:
        raise AssertionError(f"{parser.prog} {' '.join(argv)}: the parser refused it (exit {exc.code})") from None


def check_slime(argv: list[str]) -> None:
    args, extra = parse_or_fail(build_parser(), argv, known=True)
    if extra and not getattr(args, "takes_overrides", False):
        raise AssertionError(f"slime {' '.join(argv)}: unrecognized arguments {extra}")
    command = args.command
    if command == "pipeline":
        check_flow("flows.pipeline", extra)
    elif command == "engine":  # imported here: the engine server module pulls in the engine's own dependencies
        from slime.engines.builtin.server import build_parser as engine_parser

        parse_or_fail(engine_parser(), extra)
    elif getattr(args, "takes_overrides", False):  # the stages and `config show`
        check_config(args.config, extra)


def module_source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"python -m {module}: no such module"
    origin = Path(spec.origin)
    if origin.name == "__init__.py" and (origin.parent / "__main__.py").exists():
        origin = origin.parent / "__main__.py"
    return origin.read_text()


def check_flow(module: str, argv: list[str]) -> None:
    # imported here: flows._cli imports Prefect, needed only when a flow command is shown
    from flows._cli import parse

    takes_model = "takes_model=True" in module_source(module)
    params = parse(f"python -m {module}", "", [a for a in argv if a != "--json"], takes_model)
    check_config(params["config"], params["overrides"])


def check_python(argv: list[str]) -> None:
    if argv[0] != "-m":
        assert (ROOT / argv[0]).is_file(), f"python {argv[0]}: no such file"
        return
    module, rest = argv[1], argv[2:]
    if module in ("venv", "pip"):
        return
    if module == "pytest":
        check_pytest(rest)
        return
    source = module_source(module)
    if module.startswith("flows.") and "flows._cli import" in source:
        check_flow(module, rest)
    elif stage := re.search(r"main\(\[\"([\w-]+)\"", source):  # python -m slime.rl / slime.stages.<stage>
        check_slime([stage.group(1), *rest])
    else:  # any other module: each --flag must be one it declares
        for flag in (a.split("=")[0] for a in rest if a.startswith("--")):
            assert f'"{flag}"' in source, f"python -m {module}: {flag} is not among its arguments"


def check_pytest(argv: list[str]) -> None:
    markers = {line.split(":")[0].strip() for line in
               re.findall(r'^\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text().split("markers = [")[1]
                          .split("]")[0], re.M)}
    args = iter(argv)
    for arg in args:
        if arg == "-m":
            words = set(re.findall(r"\w+", next(args))) - {"and", "or", "not"}
            assert words <= markers, f"pytest -m: unknown markers {words - markers}"
        elif arg == "-k":
            next(args)
        elif not arg.startswith("-"):
            assert (ROOT / arg.split("::")[0]).exists(), f"pytest {arg}: no such test path"


def check_prefect(argv: list[str]) -> None:
    assert (Path(sys.executable).parent / "prefect").exists(), "prefect is not installed in this environment"
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    if argv[:2] == ["deployment", "run"]:
        flow_name, _, name = argv[2].partition("/")
        assert name in {d["name"] for d in deployments}, f"prefect.yaml has no deployment {name!r}"
        flows = "\n".join(p.read_text() for p in (ROOT / "flows").glob("*.py"))
        assert f'@flow(name="{flow_name}"' in flows, f"no flow named {flow_name!r} in flows/"


def check_command(argv: list[str]) -> None:
    while argv and ENV.match(argv[0]):  # VAR=value before the command
        argv = argv[1:]
    if not argv:
        return
    program = argv[0].removeprefix(".venv/bin/")
    if program == "make":
        check_make(argv[1:])
    elif program == "slime":
        check_slime(argv[1:])
    elif program in ("python", "python3"):
        check_python(argv[1:])
    elif program == "pytest":
        check_pytest(argv[1:])
    elif program == "prefect":
        check_prefect(argv[1:])
    elif program in ("bash", "sh"):
        assert (ROOT / argv[1]).is_file(), f"{program} {argv[1]}: no such file"
    elif program in ("source", "."):
        assert argv[1:] == [".venv/bin/activate"], f"{' '.join(argv)}: only the venv is sourced"
    elif program == "export":
        pass
    elif program not in PIPE_TARGETS:
        raise AssertionError(f"{program}: no check for this command in tests/test_docs.py; add one")


@pytest.mark.parametrize("path", COMMANDS_CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shown_commands_name_real_entry_points_and_flags(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs and scripts are named from the project root, as the docs say
    commands = shell_commands(path)
    assert commands, f"{path}: no ```bash block"
    problems = []
    for where, argv in commands:
        try:
            check_command(argv)
        except Exception as exc:  # an AssertionError here, a ConfigError from load_config
            problems.append(f"{where}: {' '.join(argv)}\n    {type(exc).__name__}: {exc}")
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_wrong_command():
    for argv in (["make", "runn"], ["slime", "rll"], ["slime", "rl", "--rollout-batch-sise", "8"],
                 ["python", "-m", "flows.pipline"], ["slime", "engine", "--modle", "x"],
                 ["pytest", "-m", "gpuu"], ["prefect", "deployment", "run", "post-training/nothing"]):
        with pytest.raises((AssertionError, ConfigError)):
            check_command(argv)


# --- the README's figures, the index, the refusal table -----------------------------------------------------------

def section(path: Path, title: str) -> list[str]:
    lines, inside = [], False
    for _, line in prose_lines(path.read_text()):
        if match := HEADING.match(line):
            inside = match.group(2).strip() == title
        elif inside:
            lines.append(line)
    return lines


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines: it is the front door; move detail to "
                                            f"docs/ (measurements: docs/benchmarks.md)")


def test_readme_figures_are_in_benchmarks():
    figures = [line for line in section(ROOT / "README.md", "Current figures") if line.startswith("* ")]
    assert figures, "README.md has no '## Current figures' list"
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    for line in figures:
        assert "(docs/benchmarks.md#" in line, f"README figure without its docs/benchmarks.md section: {line}"
        text = re.sub(r"\]\([^)]*\)", "]", line)  # numbers in link targets do not count
        for number in re.findall(r"\d+(?:[.,]\d+)*", text):
            assert number in benchmarks, f"README figure {number} is not in docs/benchmarks.md: {line}"


def test_docs_index_lists_every_doc():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in DOCS if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"


TABLE_START = "<!-- refused flags: generated"
TABLE_END = "<!-- end of refused flags -->"
# the tables of `slime config reference` with a refused state, and whose flags they are
REFUSAL_TABLES = {"slime's flags": "slime", "Megatron-LM launch flags": "Megatron-LM",
                  "Other flags of slime's launch scripts": "slime's SGLang launcher"}


def refused_table() -> str:
    """The refused rows of `slime config reference` (slime/config_reference.py reference_markdown) as one table."""
    rows, owner = [], None
    for line in reference_markdown().splitlines():
        if line.startswith("## "):
            owner = REFUSAL_TABLES.get(line[3:].strip())
        elif owner and line.startswith("| `--"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            state, why = (cells[3], cells[4]) if len(cells) == 5 else (cells[1], cells[2])
            if state == "refused":
                rows.append(f"| {cells[0]} | {owner} | {why} |")
    return "\n".join(["| flag | whose | why it is refused here |", "|---|---|---|", *rows])


def generated_span(text: str) -> tuple[int, int]:
    """Where the generated table sits in docs/from-slime.md: between the line of TABLE_START and TABLE_END."""
    start = text.index("\n", text.index(TABLE_START)) + 1
    return start, text.index(TABLE_END)


def test_from_slime_refusal_table_is_generated():
    text = (ROOT / "docs" / "from-slime.md").read_text()
    start, end = generated_span(text)
    assert text[start:end].strip() == refused_table(), (
        "docs/from-slime.md's refused-flag table is stale: run `make docs` (or `python tests/test_docs.py --write`)")
    assert refused_table().count("\n") > 10


def write_refusal_table() -> None:
    path = ROOT / "docs" / "from-slime.md"
    text = path.read_text()
    start, end = generated_span(text)
    path.write_text(text[:start] + refused_table() + "\n" + text[end:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_refusal_table()
    else:
        sys.exit("usage: python tests/test_docs.py --write   (rewrites docs/from-slime.md's refused-flag table)")
