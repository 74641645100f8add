"""The house: the folders are the layers, and no import runs upward or in a circle. Parsed with ast (nothing is
imported), so a new arrow fails here.

Floors, bottom up (a module may import its own floor and those below): ``corp_deploy.base`` (errors, files,
tables, the optional-dependency gate, the environment, timing); ``families`` (what a model is); ``core`` (the pruning
algorithm); ``formats`` (artifacts, inputs, evaluation); the libraries ``exporters`` and, above it, ``bench``, which
read the pruning side only through ``base``, ``families`` and ``formats`` (the exporters never import the benchmarks:
what both time with is in ``base.timing``); ``plan`` (widths under a budget or a measured speed), which reads neither
library: a latency measurement is handed in where the API is wired (``plan.speed.Meter``), so a plain sparsity prune
never loads the export stack; ``corp_deploy.api`` and the package itself (the facade); and on top the
apps: ``apps``, the CLI, the entry point and the scripts outside the package (``studies/``, ``tools/``), which nothing
in the package imports. Nothing but the entry point imports the CLI.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

FOLDERS = {
    "corp_deploy": "corp_deploy",
    "studies": "studies",
    "tools": "tools",
}
"""Repository folder -> the dotted name its modules import as."""
SCRIPTS = ("studies", "tools")
"""Run from the repository root, never installed: the package must not import them."""
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("corp_deploy.base",)),
    ("families", ("corp_deploy.families",)),
    ("core", ("corp_deploy.core",)),
    ("formats", ("corp_deploy.formats",)),
    ("exporters", ("corp_deploy.exporters",)),
    ("bench", ("corp_deploy.bench",)),
    ("plan", ("corp_deploy.plan",)),
    ("api", ("corp_deploy.api",)),
    ("app", ("corp_deploy.apps", "corp_deploy.cli", "corp_deploy.__main__", *SCRIPTS)),
)
"""Folder prefixes of each floor, bottom up (a prefix covers its submodules); the package itself is ``api``."""
RANK = {name: rank for rank, (name, _) in enumerate(FLOORS)}
SKIPPED = {"exporters": frozenset({"core"}), "bench": frozenset({"core"}), "plan": frozenset({"exporters", "bench"})}
"""Floors below a floor that it still may not read. The libraries convert and time what the pruning side wrote:
they read it through ``base``, ``families`` and ``formats``, never the algorithm. The plan is handed its latency
measurement (``plan.speed.Meter``), never the export stack."""
CLI = "corp_deploy.cli"
ENTRY_POINTS = frozenset({"corp_deploy.__main__"})
TOP_LEVEL = frozenset({"__init__.py", "__main__.py", "api.py"})
"""The only modules at the package's top level; everything else lives in the folder of its floor."""


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def floor(module: str) -> str:
    if module == "corp_deploy":
        return "api"
    found = [name for name, prefixes in FLOORS if any(_within(module, p) for p in prefixes)]
    if len(found) != 1:
        raise ValueError(f"{module} is on no floor (or on several): {found}")
    return found[0]


def allowed(src: str, dst: str) -> bool:
    """Whether module ``src`` may import project module ``dst``."""
    if _within(dst, CLI) and not (_within(src, CLI) or src in ENTRY_POINTS):
        return False
    if dst.split(".")[0] in SCRIPTS and src.split(".")[0] not in SCRIPTS:
        return False
    here, there = floor(src), floor(dst)
    return RANK[there] <= RANK[here] and there not in SKIPPED.get(here, ())


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
        ("corp_deploy.base.fsio", "from corp_deploy.families.timm.models import create_model"),
        ("corp_deploy.base.env", "def f():\n    import corp_deploy.api"),
        ("corp_deploy.core.pruner", "from corp_deploy.exporters.runners import OrtRunner"),
        ("corp_deploy.families.timm.models", "from corp_deploy.bench import accuracy"),
        ("corp_deploy.exporters.int8_quant", "from corp_deploy.api import SYNTHETIC"),
        ("corp_deploy.bench.accuracy", "from corp_deploy.core.compensation import ridge_solve"),
        ("corp_deploy.bench.backends", "from corp_deploy.plan import speed"),
        ("corp_deploy.core.pruner", "from corp_deploy.formats.artifact import save_pruned"),
        ("corp_deploy.families.hf.adapter", "from corp_deploy.core.stats import collect"),
        ("corp_deploy.plan.allocation", "from corp_deploy.apps import sweep"),
        ("corp_deploy.base.fsio", "import corp_deploy"),
        ("corp_deploy.apps.demo", "from corp_deploy.cli import main"),
        ("corp_deploy.apps.demo", "from studies.budget_study import main"),
        ("corp_deploy.bench.run", "from tools.gpu_suite.core import measure"),
        ("corp_deploy.plan.speed", "from corp_deploy.exporters.onnx_export import export_onnx"),
        ("corp_deploy.plan.loop", "def f():\n    from corp_deploy.bench.meter import check_backend"),
        ("corp_deploy.exporters.int4", "from corp_deploy.bench.decode import GenaiSession"),
        ("corp_deploy.exporters.int8_recipes", "from corp_deploy.bench import run"),
    ],
)
def test_the_check_catches_an_upward_import(module: str, source: str) -> None:
    assert violations(module, source, set(modules()))


def test_the_check_allows_the_floors_below() -> None:
    known = set(modules())
    for module, source in [
        ("corp_deploy.base.env", "from corp_deploy.base.deps import optional"),
        ("corp_deploy.api", "from corp_deploy.core.pruner import prune_model\nfrom corp_deploy.base import env"),
        (
            "corp_deploy.exporters.int8_quant",
            "from corp_deploy.formats.data import SYNTHETIC\nfrom corp_deploy.base.fsio import staged",
        ),
        (
            "corp_deploy.bench.backends",
            "from corp_deploy.formats.artifact import load_pruned\nfrom corp_deploy.exporters.runners import OrtRunner",
        ),
        ("corp_deploy.apps.sweep", "from corp_deploy.core.pruner import calibrate"),
        ("corp_deploy.plan.speed", "from corp_deploy.base.timing import interleaved"),
        ("corp_deploy.exporters.int4", "from corp_deploy.base.timing import GenaiSession"),
        ("corp_deploy.bench.meter", "from corp_deploy.exporters.onnx_export import export_onnx"),
        ("corp_deploy.cli.prune", "from corp_deploy.bench.meter import check_backend"),
        ("corp_deploy.__main__", "from corp_deploy.cli import main"),
        (
            "studies.budget_study",
            "from corp_deploy.apps.real import real_model\nfrom corp_deploy.apps.sweep import sweep",
        ),
    ]:
        assert violations(module, source, known) == [], module


def test_every_module_is_on_exactly_one_floor() -> None:
    """A folder that is on no floor (or a prefix that matches none) would silently stop being checked."""
    known = set(modules())
    assert {floor(m) for m in known} == set(RANK)
    for _, prefixes in FLOORS:
        assert all(any(_within(m, p) for m in known) for p in prefixes), prefixes


def test_the_package_top_level_holds_only_the_facade() -> None:
    top = {p.name for p in (ROOT / "corp_deploy").iterdir() if p.suffix == ".py"}
    assert top == TOP_LEVEL


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (module -> modules it imports), or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere; a package's ``__init__`` that a submodule passes through
    on its way in is not an arrow back (``from corp_deploy.families.registry import x`` reads the registry)."""
    files = modules()
    known = set(files)
    return {name: imported(name, path.read_text(), known) - {name} for name, path in files.items()}


def test_no_import_circle() -> None:
    found = cycle(import_graph())
    assert not found, "import circle: " + " -> ".join(found)


def test_the_circle_check_finds_a_circle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_light_modules_load_neither_torch_nor_timm() -> None:
    code = (
        "import sys, corp_deploy; from corp_deploy.base import deps, env, errors, fsio, tables, version; "
        "print(sorted(m for m in ('torch', 'timm') if m in sys.modules))"
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


def test_no_test_module_imports_conftest() -> None:
    """Builders live in ``helpers``, fixtures in ``conftest``: conftest may use helpers, never the reverse, and no
    test imports conftest as a module (pytest loads it itself; an import would make a second copy of it)."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [str(path.relative_to(ROOT)) for name in names if name.split(".")[-1] == "conftest"]
    assert not bad, bad


def test_the_development_layout_lists_every_module_under_its_folder() -> None:
    """docs/DEVELOPMENT.md's layout is drawn from the folders: each module on disk is listed under its folder (a
    package's ``__init__.py`` may be), and nothing listed is gone."""
    text = (ROOT / "docs" / "DEVELOPMENT.md").read_text()
    block = text.split("## Layout", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    listed, folder = set(), ""
    for line in block.splitlines():
        name = line.split()[0]
        if line.startswith(" "):
            listed.add(folder + name)
        else:
            folder = name
    on_disk = {str(p.relative_to(ROOT)) for p in modules().values()}
    packages = {p for p in on_disk if p.endswith("__init__.py")}
    assert sorted(on_disk - packages - listed) == [], "modules missing from the layout"
    assert sorted(listed - on_disk) == [], "listed in the layout, not on disk"


def test_the_plan_and_the_facade_load_no_export_stack() -> None:
    """A plain sparsity prune through the API loads neither the exporters nor the benchmarks (nor onnx): the plan is
    handed its latency measurement where one is asked for (``plan.speed.Meter``)."""
    code = (
        "import sys, corp_deploy.api, corp_deploy.plan.loop, corp_deploy.plan.speed, corp_deploy.plan.width_plan; "
        "print(sorted(m for m in sys.modules if m.startswith(('corp_deploy.exporters', 'corp_deploy.bench', 'onnx'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
