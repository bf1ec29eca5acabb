"""The house's import rules beside the import-linter contract (pyproject.toml `[tool.importlinter]`, run by
`make test` as `lint-imports`): every room of `slime/` stands on a floor of the contract, no two modules import
each other through any chain (a circle inside one floor is invisible to a layers contract), and an import
inside a function is for a heavy dependency only, never to dodge a circle.

    python tests/test_imports.py    # every function-level import left, grouped by the heavy dependency it defers
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("slime", "tasks", "flows")

# what may be imported inside a function, and why: importing it costs seconds or needs a machine it may not
# be on; a slime module counts when its own module-level imports reach one of these
HEAVY: dict[str, str] = {
    "torch": "the model stack: seconds to import; the CLI, the config and the Prefect flows' driver start without it",
    "megatron": "megatron-core: seconds to import, on the train ranks only",
    "mbridge": "the HF <-> Megatron bridge: imports megatron-core",
    "transformers": "tokenizers and HF models: seconds to import; the driver and the config checks need no model",
    "peft": "PEFT adapter export only (imports transformers)",
    "triton": "GPU kernels: CUDA machines only",
    "sglang": "SGLang: GPU machines only (needs CUDA)",
    "sglang_router": "the router's flag table: imported where a router is started or its flags checked",
    "ray": "Ray: the cluster runtime, ~1 s to import; stages without Ray (convert, SFT, export) never load it",
    "prefect": "Prefect: the orchestration layer only; the library runs without it",
    "pyarrow": "the store's columnar I/O: the CLI's config commands and the engines' processes start without it",
    "uvicorn": "the built-in engine's HTTP server process only",
    "wandb": "optional experiment tracking (--use-wandb)",
    "tensorboard": "optional experiment tracking (--use-tensorboard)",
    "memray": "optional memory profiling (--memory-snapshot-path with memray installed)",
    "math_verify": "optional grader (rm_type math_verify)",
    "xxhash": "delta sync's checksum algorithm chosen by --update-weight-delta-checksum",
    "blake3": "delta sync's checksum algorithm chosen by --update-weight-delta-checksum",
}


def modules() -> dict[str, Path]:
    """Every module of the house by dotted name."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level or not node.module:
        return []
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]


def _module_level(tree: ast.Module, known: dict[str, Path]) -> list[str]:
    """What a module imports when it is imported: its top-level statements and the blocks (if/try) among them."""
    out = []
    for statement in tree.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Import | ast.ImportFrom):
                out += _imported(node, known)
    return out


def heavy_dependency(module: str, known: dict[str, Path], trees: dict[str, ast.Module],
                     seen: frozenset[str] = frozenset()) -> str | None:
    """The heavy dependency importing `module` brings in (itself or through its module-level imports), or None."""
    if module.split(".")[0] in HEAVY:
        return module.split(".")[0]
    if module not in known or module in seen:
        return None
    for name in _module_level(trees[module], known):
        if found := heavy_dependency(name, known, trees, seen | {module}):
            return found
    return None


def function_level_imports() -> list[tuple[str, int, str, str | None]]:
    """(file, line, module imported, the heavy dependency it defers or None) of every import inside a function."""
    known = modules()
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in known.items()}
    found = []
    for name, tree in trees.items():
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    for target in _imported(node, known):
                        found.append((str(known[name].relative_to(ROOT)), node.lineno, target,
                                      heavy_dependency(target, known, trees)))
    return sorted(set(found))


def test_every_room_of_slime_stands_on_a_floor_of_the_contract():
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    named = {name.strip() for c in contract["contracts"] for layer in c.get("layers", [])
             for name in layer.split("|")}
    rooms = {f"slime.{p.stem if p.suffix == '.py' else p.name}" for p in (ROOT / "slime").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert rooms - named == set(), "add these to a floor of [tool.importlinter] in pyproject.toml"
    assert {"flows", "tasks"} <= named


def test_no_module_imports_itself_through_a_chain():
    """Strongly connected modules (function-level imports included): none."""
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*PACKAGES)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    circles = [c for c in _strongly_connected(edges) if len(c) > 1]
    assert circles == [], "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in circles)


def test_imports_inside_functions_only_defer_heavy_dependencies():
    light = [f"{path}:{line}: {module}" for path, line, module, heavy in function_level_imports() if heavy is None]
    assert light == [], ("imports inside functions that defer nothing heavy (move them to the top of the module; "
                         "if that makes a circle, move the shared piece down a floor):\n  " + "\n  ".join(light))


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
    return out


if __name__ == "__main__":
    grouped: dict[str | None, list[str]] = defaultdict(list)
    for path, line, module, heavy in function_level_imports():
        grouped[heavy].append(f"{path}:{line} {module}")
    for heavy, places in sorted(grouped.items(), key=lambda kv: (kv[0] is None, -len(kv[1]))):
        print(f"{heavy or 'NOT HEAVY'} ({len(places)}): {HEAVY.get(heavy, 'move to the top of the module')}")
        for place in places:
            print(f"    {place}")
