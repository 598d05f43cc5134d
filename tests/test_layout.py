"""The package's layout is a contract: layers that import downwards only, no import hidden in a
function to dodge a cycle, and modules and functions a reader can hold in mind."""

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fxoffload"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
# A function longer than MAX_FUNCTION_LINES says why in a comment that starts with this.
LONG_REASON = "# long:"


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _lint_imports(cwd: pathlib.Path, path: pathlib.Path) -> subprocess.CompletedProcess:
    """import-linter in a process of its own (it configures logging, which would silence the rest of
    the suite's log capture), on the package found at ``path``."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(path)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_layers_contract_holds():
    """import-linter's contracts in pyproject.toml: tools > testing > compiler > reporting > rewrite >
    planning | measure > analysis > runtime > the core modules; the pass never imports the runtime."""
    pytest.importorskip("importlinter", reason="import-linter is a test dependency")
    run = _lint_imports(ROOT, ROOT)
    assert run.returncode == 0, f"an import crosses the layers:\n{run.stdout[-3000:]}"


def test_no_function_imports_a_module_of_the_package():
    """Imports of fxoffload's own modules are at the top of a module: one inside a function is how a
    cycle between layers is hidden."""
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.level > 0 or (inner.module or "").startswith("fxoffload")):
                    found.append(f"{path.relative_to(ROOT)}:{inner.lineno} in {node.name}")
                elif isinstance(inner, ast.Import) and any(a.name.startswith("fxoffload") for a in inner.names):
                    found.append(f"{path.relative_to(ROOT)}:{inner.lineno} in {node.name}")
    assert not found, found


def test_modules_and_functions_stay_small_or_say_why():
    too_long = []
    for path in _modules():
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                if length > MAX_FUNCTION_LINES and LONG_REASON not in body:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long


def test_the_layout_check_fails_on_an_import_that_goes_up(tmp_path):
    """The contract is not a test that cannot fail: a planning module importing the compiler is refused."""
    pytest.importorskip("importlinter", reason="import-linter is a test dependency")
    copy = tmp_path / "fxoffload"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    plan = copy / "planning" / "plan.py"
    plan.write_text(plan.read_text().replace("from ..options import", "from ..compiler import backend\nfrom ..options import", 1))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    run = _lint_imports(tmp_path, tmp_path)
    assert run.returncode != 0 and "fxoffload.planning.plan -> fxoffload.compiler" in run.stdout, run.stdout[-2000:]


def test_the_guide_to_the_layout_names_every_module():
    """docs/how-it-works.md draws the package as a tree, a line per layer (continued on indented
    lines): every module of every layer is named on its layer's lines, so the map a reader starts
    from does not fall behind the code."""
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    start = text.index("```\nfxoffload/\n") + 4
    tree = text[start : text.index("```", start)]
    layers: dict[str, str] = {}
    layer = None
    for line in tree.splitlines()[1:]:
        head = line[:15].strip()
        if head.endswith("/") and not head.startswith("_"):
            layer = head[:-1]
        elif head:
            layer = None
        if layer is not None:
            layers[layer] = layers.get(layer, "") + " " + line[15:]
    missing = {}
    packages = [p for p in PACKAGE.iterdir() if (p / "__init__.py").exists() and not p.name.startswith("_")]
    for package in sorted(packages):
        named = set(layers.get(package.name, "").replace(",", " ").replace("(", " ").replace(")", " ").split())
        modules = {m.stem for m in package.glob("*.py") if m.stem != "__init__"}
        if modules - named:
            missing[package.name] = sorted(modules - named)
    assert not missing, f"add to the layout tree of docs/how-it-works.md: {missing}"
