"""The house: no import runs upward. Parsed with ast (nothing is imported), so a new arrow fails here.

Floors, bottom up: the rooms (import nothing of the project but each other); the pruning core; the
libraries beside it (``exporters/`` and ``bench/``, installed as ``corp_deploy.exporters`` and
``corp_deploy.bench``), which read the core only through the artifact and input formats; the apps on
top, which may import anything: the CLI, the demo, the sweep, and the scripts outside the package
(``studies/``, ``tools/``), which nothing in the package imports. Nothing but the entry point imports
the CLI.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "corp_deploy": "corp_deploy",
    "exporters": "corp_deploy.exporters",
    "bench": "corp_deploy.bench",
    "studies": "studies",
    "tools": "tools",
}
"""Repository folder -> the dotted name its modules import as (pyproject's ``package-dir``)."""
LIBRARIES = ("corp_deploy.exporters", "corp_deploy.bench")
SCRIPTS = ("studies", "tools")
"""Run from the repository root, never installed: the package must not import them."""

ROOMS = frozenset({"corp_deploy.errors", "corp_deploy.fsio", "corp_deploy.tables", "corp_deploy.version"})
ROOMS |= {"corp_deploy.deps", "corp_deploy.env"}
FORMATS = frozenset({"corp_deploy.artifact", "corp_deploy.data", "corp_deploy.families"})
"""The pruning core's faces that the libraries may read: prune artifacts, images as a model takes them, and the
family registry (what a model is: a decode graph asks its family for its cache widths and positions)."""
APPS = (
    "corp_deploy.cli",
    "corp_deploy.__main__",
    "corp_deploy.demo",
    "corp_deploy.sweep",
    "corp_deploy.floor",
    "corp_deploy.real",
    "corp_deploy.speed",
    *SCRIPTS,
)
"""App-level modules and packages (a name covers its submodules): they may import anything but the scripts."""
CLI = "corp_deploy.cli"
ENTRY_POINTS = frozenset({"corp_deploy.__main__"})


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def floor(module: str) -> str:
    if module in ROOMS:
        return "room"
    if any(_within(module, app) for app in APPS):
        return "app"
    if any(_within(module, lib) for lib in LIBRARIES):
        return "library"
    return "core"


def allowed(src: str, dst: str) -> bool:
    """Whether module ``src`` may import project module ``dst``."""
    if _within(dst, CLI) and not (_within(src, CLI) or src in ENTRY_POINTS):
        return False
    if dst.split(".")[0] in SCRIPTS and src.split(".")[0] not in SCRIPTS:
        return False
    rules = {
        "room": dst in ROOMS,
        "core": floor(dst) in ("room", "core"),
        "library": dst in ROOMS or dst in FORMATS or floor(dst) == "library",
        "app": True,
    }
    return rules[floor(src)]


@functools.cache
def modules() -> dict[str, Path]:
    """Every project module by dotted name (``pkg/__init__.py`` is ``pkg``)."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = (*package.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(module: str, source: str, known: set[str]) -> set[str]:
    """Project modules that ``source`` imports anywhere (top level, functions, TYPE_CHECKING blocks)."""
    files = modules()
    is_package = module in files and files[module].name == "__init__.py"
    package = (module if is_package else module.rpartition(".")[0]).split(".")
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[: len(package) - node.level + 1], node.module or ""]).strip(".")
            base = base if node.level else node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one, else a name of ``pkg``.
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m.split(".")[0] in ("corp_deploy", *SCRIPTS)}


def violations(module: str, source: str, known: set[str]) -> list[str]:
    return [
        f"{module} ({floor(module)}) imports {dst} ({floor(dst)})"
        for dst in sorted(imported(module, source, known))
        if not allowed(module, dst)
    ]


def test_no_import_runs_upward() -> None:
    files = modules()
    known = set(files)
    bad = [v for name, path in files.items() for v in violations(name, path.read_text(), known)]
    assert not bad, "imports against the house:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "module, source",
    [
        ("corp_deploy.fsio", "from corp_deploy.models import create_model"),
        ("corp_deploy.env", "def f():\n    import corp_deploy.api"),
        ("corp_deploy.pruner", "from corp_deploy.exporters.runners import OrtRunner"),
        ("corp_deploy.models", "from corp_deploy.bench import accuracy"),
        ("corp_deploy.exporters.quantize", "from corp_deploy.api import SYNTHETIC"),
        ("corp_deploy.bench.accuracy", "from corp_deploy.compensation import ridge_solve"),
        ("corp_deploy.bench.backends", "from corp_deploy import models"),
        ("corp_deploy.demo", "from corp_deploy.cli import main"),
        ("corp_deploy.demo", "from studies.budget_study import main"),
        ("corp_deploy.bench.run", "from tools.gpu_suite.core import measure"),
    ],
)
def test_the_check_catches_an_upward_import(module: str, source: str) -> None:
    assert violations(module, source, set(modules()))


def test_the_check_allows_the_floors_below() -> None:
    known = set(modules())
    for module, source in [
        ("corp_deploy.env", "from corp_deploy.deps import optional"),
        ("corp_deploy.api", "from corp_deploy.pruner import prune_model\nfrom corp_deploy import env"),
        (
            "corp_deploy.exporters.quantize",
            "from corp_deploy.data import SYNTHETIC\nfrom corp_deploy.fsio import staged",
        ),
        (
            "corp_deploy.bench.backends",
            "from corp_deploy.artifact import load_pruned\nfrom corp_deploy.exporters.runners import OrtRunner",
        ),
        ("corp_deploy.sweep", "from corp_deploy.pruner import calibrate"),
        ("corp_deploy.__main__", "from corp_deploy.cli import main"),
        ("studies.budget_study", "from corp_deploy.real import real_model\nfrom corp_deploy.sweep import sweep"),
    ]:
        assert violations(module, source, known) == [], module


def test_every_module_is_on_a_floor_that_exists() -> None:
    """A listed room or format that was renamed away would silently stop being checked."""
    known = set(modules())
    assert known >= ROOMS | FORMATS
    assert all(any(_within(m, app) for m in known) for app in APPS)


def test_light_modules_load_neither_torch_nor_timm() -> None:
    code = (
        "import sys; import corp_deploy.errors, corp_deploy.fsio, corp_deploy.tables, corp_deploy.deps, "
        "corp_deploy.version, corp_deploy.env; print(sorted(m for m in ('torch', 'timm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_documents_cited_in_the_code_are_in_the_repository() -> None:
    """A docstring that cites a document (``DESIGN.md``, ``docs/BENCHMARKS.md``) must find it in this repository."""
    cited = {
        (path.relative_to(ROOT), name)
        for path in modules().values()
        for name in re.findall(r"\b(?:docs/)?[A-Z][A-Z_]*\.md\b", path.read_text())
    }
    missing = sorted(
        f"{path} cites {name}" for path, name in cited if not any((d / name).is_file() for d in (ROOT, ROOT / "docs"))
    )
    assert not missing, missing


def test_every_public_name_resolves_to_the_module_that_defines_it() -> None:
    """``corp_deploy``'s lazy exports name modules by string: a name moved to another module must move here too."""
    import corp_deploy

    for name in corp_deploy.__all__:
        value = getattr(corp_deploy, name)
        assert name == "__version__" or value.__module__ == corp_deploy._EXPORTS[name], name
