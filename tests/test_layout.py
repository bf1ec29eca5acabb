"""House rules that keep the layout meaningful (DESIGN.md section 2)."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from slime.config import load_config
from slime.data.tiny import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_library_never_imports_prefect():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "slime").rglob("*.py") if "prefect" in _imports(p)]
    assert offenders == []


def test_importing_the_library_loads_no_orchestration():
    code = ("import sys, slime.config, slime.types, slime.storage, slime.data.prompts, slime.data.tiny, slime.cli;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_datasets_dir_does_not_shadow_hugging_face_datasets():
    assert not (ROOT / "datasets" / "__init__.py").exists()
    spec = importlib.util.find_spec("datasets")
    assert spec is None or not str(spec.origin or "").startswith(str(ROOT / "datasets"))


@pytest.mark.parametrize("path", sorted((ROOT / "deployments").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    config = load_config(path)
    assert path.read_text().startswith("#"), "each deployment config opens with a comment on what it runs"
    assert config.run.run_id


@pytest.mark.parametrize("path", sorted((ROOT / "datasets").glob("*/recipe.yaml")), ids=lambda p: p.parent.name)
def test_shipped_recipe_validates(path):
    assert load_recipe(path).seed >= 0


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make run" in (ROOT / "README.md").read_text() and "make test" in (ROOT / "README.md").read_text()
