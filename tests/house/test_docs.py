"""The documents hold together: every relative link a reader can follow resolves (the file, and the heading an
``#anchor`` names, as GitHub slugs it), and no docstring or comment in the package names a module that is gone.

Both are parsed, nothing is imported or fetched: a moved study output, a renamed heading or module fails here.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from helpers import ROOT

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def documents() -> list[Path]:
    """What a reader opens: the READMEs and every guide under docs/."""
    return [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation but ``-`` and ``_`` removed, spaces to
    hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a markdown file: its headings' slugs (a repeated one numbered ``-1``, ``-2``...) and HTML ids."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``path`` whose file is missing or whose ``#anchor`` is not a heading there."""
    bad = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_relative_link_in_the_documents_resolves() -> None:
    bad = [b for path in documents() for b in broken_links(path)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path) -> None:
    doc = tmp_path / "doc.md"
    (tmp_path / "other.md").write_text("# Other\n\n## Setup, demo and test-suite times\n\n```\n# not a heading\n```\n")
    links = [
        "[ok](other.md#setup-demo-and-test-suite-times)",
        "[ok](#a-b)",
        "[gone](missing.md)",
        "[moved](other.md#not-a-heading)",
        "[web](https://example.org/x.md)",
    ]
    doc.write_text("# A: b\n\n" + "\n".join(links) + "\n\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(doc, tmp_path) == [
        "doc.md: missing.md (no such file)",
        "doc.md: other.md#not-a-heading (no such heading)",
    ]


def test_slugs_follow_github() -> None:
    assert slug("INT4 as fast as the runtime allows: genai's builder recipes (issue 43 item 3)") == (
        "int4-as-fast-as-the-runtime-allows-genais-builder-recipes-issue-43-item-3"
    )
    assert slug("Exact fixed-cost rewrites (`exporters/rewrites.py`, `--rewrites`)") == (
        "exact-fixed-cost-rewrites-exportersrewritespy---rewrites"
    )


# ------------------------------------------------------------------------------------- module names in the code

PACKAGE = ROOT / "corp_deploy"
FOLDERS = ("corp_deploy", "studies", "tools")
CODE_NAME = re.compile(r"``?([A-Za-z_][\w./]*[\w])``?")
"""A name in backticks: a dotted name (``bench.run.new_record``) or a path (``exporters/rewrites.py``)."""
FLAT = frozenset({"family", "hf_folder", "hf_modeling", "hf_text", "measure", "timm_vit", "hf_vit", "perplexity"})
"""Modules of the flat layout the folders replaced: a name starting with one is a module that is gone."""
DATA_SUFFIXES = frozenset({"json", "jsonl", "md", "onnx", "png", "csv", "txt", "yml", "safetensors", "data", "log"})


@functools.cache
def project_modules() -> dict[str, Path]:
    """Every module of the repository's Python folders by dotted name (a package by its own name)."""
    found = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache
def top_level_names(path: Path) -> frozenset[str]:
    """What ``module.NAME`` can read in a module: its definitions, assignments, imports and classes' members."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            lazy = any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets)  # ``corp_deploy``'s exports
            if lazy and isinstance(node.value, ast.Dict):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return frozenset(names)


def _module_names() -> dict[str, str]:
    """A module's dotted name as the code cites it: in full, or below ``corp_deploy`` (``plan.speed``)."""
    out = {}
    for name in project_modules():
        out[name] = name
        if name.startswith("corp_deploy."):
            out[name.removeprefix("corp_deploy.")] = name
    return out


def stale(name: str) -> bool:
    """Whether a cited name looks like a project module path (``exporters/x.py``, ``plan.speed.f``) and is none.

    A path must be the tail of a file in the repository. A dotted name whose head is a package of the tree (``bench``,
    ``corp_deploy``, ``studies``) must resolve: its longest module prefix, then one name defined there."""
    modules = _module_names()
    if name.endswith(".py") and "/" in name:
        files = {str(p.relative_to(ROOT)) for folder in (*FOLDERS, "tests") for p in (ROOT / folder).rglob("*.py")}
        return not any(f == name or f.endswith("/" + name) for f in files)
    if name.rpartition(".")[2] in DATA_SUFFIXES:  # a file name (``bench.json``), not a module
        return False
    parts = name.split(".")
    if len(parts) > 1 and parts[0] in FLAT:
        return True
    packages = {n.split(".")[0] for n in modules}
    if "/" in name or len(parts) < 2 or parts[0] not in packages:
        return False
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in modules:
            rest = parts[cut:]
            return bool(rest) and rest[0] not in top_level_names(project_modules()[modules[head]])
    return True


def cited_names(path: Path) -> set[str]:
    """Names in backticks within the docstrings and comments of ``path``."""
    source = path.read_text()
    texts = [
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]
    texts += [line.split("#", 1)[1] for line in source.splitlines() if "#" in line]
    return {m for text in texts for m in CODE_NAME.findall(text)}


def test_no_docstring_or_comment_names_a_module_that_is_gone() -> None:
    bad = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in cited_names(path)
        if stale(name)
    )
    assert not bad, "names of modules that do not exist:\n" + "\n".join(bad)


def test_the_name_check_knows_gone_modules_from_present_ones() -> None:
    gone_names = ("bench.measure.interleaved", "corp_deploy.surgery", "exporters/gone.py", "plan.speed.nothing_here")
    for gone in (*gone_names, "hf_folder.layout", "family.adapter_for"):
        assert stale(gone), gone
    for present in (
        "base.timing.interleaved",
        "corp_deploy.plan.speed.table_for",
        "exporters/rewrites.py",
        "families.timm.surgery.replace_branch",
        "plan.speed.Meter",
        "corp_deploy.load_pruned",
        "torch.compile",
        "Adapter.install",
        "studies/kv_padding.py",
    ):
        assert not stale(present), present


def test_docs_hold_what_a_user_reads() -> None:
    """docs/ is the guides and the figures they show (study outputs live in ``studies/results/``), and BENCHMARKS.md
    the current figure of each claim: its dated record is in ``docs/history/``."""
    top = sorted(p.name for p in (ROOT / "docs").iterdir())
    assert len(top) <= 15, top
    assert len((ROOT / "docs" / "BENCHMARKS.md").read_text().splitlines()) <= 1000
