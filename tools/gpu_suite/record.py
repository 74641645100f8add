"""A suite result folder as markdown, and ``--ingest``: its tables into docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from corp_deploy.base.tables import markdown_table
from tools.gpu_suite.core import SCHEMA, SuiteError
from tools.gpu_suite.registry import SECTIONS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md"
BEGIN, END = "<!-- gpu-suite:begin -->", "<!-- gpu-suite:end -->"


def machine(suite: dict[str, Any]) -> str:
    env = suite["environment"]
    if "gpu" not in env:
        return f"{env.get('cpu')} ({env.get('cpu_count')} cores, no GPU), torch {env.get('torch')}"
    return (
        f"{env['gpu']} ({env.get('gpu_memory_gib')} GiB, compute capability {env.get('compute_capability')}), "
        f"driver {env.get('driver')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, torch {env.get('torch')}, "
        f"timm {env.get('timm')}, {env.get('cpu_count')} CPU cores"
    )


def summary_markdown(suites: list[dict[str, Any]]) -> str:
    """Markdown for one or more suite runs (a slow machine splits the suite over calls; a later call
    adds a variant): every section's record from every run that made one, each labelled with its run."""
    status, records = [], []
    for i, suite in enumerate(suites, 1):
        for s in suite["sections"]:
            error = f": {s['error'].splitlines()[0]}" if s.get("error") else ""  # one line: a table cell
            status.append([s["name"], f"run {i}", s["status"] + error, f"{s['seconds']:.1f}"])
            if s["name"] in suite.get("records", {}) and (s["status"] == "ok" or s["name"] == "tests"):
                records.append((s["name"], i, suite["records"][s["name"]]))
    lines = [
        f"- run {i}: `{s['command']}`, {s['date'][:10]}, {machine(s)}"
        + (" — SMOKE (tiny model on the CPU: checks code paths, measures nothing)" if s["smoke"] else "")
        for i, s in enumerate(suites, 1)
    ]
    order = list(SECTIONS)
    status.sort(key=lambda row: order.index(row[0]))
    lines += ["", markdown_table(["section", "run", "status", "seconds"], status)]
    for name, i, record in sorted(records, key=lambda r: order.index(r[0])):
        first, *rest = SECTIONS[name].markdown(record)
        lines += ["", f"{first} — run {i}" if len(suites) > 1 else first, *rest]
    return "\n".join(lines) + "\n"


def read_suite(folder: Path) -> dict[str, Any]:
    path = folder / "suite.json"
    try:
        suite = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise SuiteError(f"{folder} is not a gpu-suite result (no readable suite.json); pass a --out folder") from None
    if not isinstance(suite, dict) or suite.get("schema") != SCHEMA:
        raise SuiteError(f"{path} is not a gpu-suite record (schema {suite.get('schema')!r}, want {SCHEMA!r})")
    return suite


def ingest(folders: list[Path], docs: Path = DOCS) -> str:
    """Replace the GPU-suite block of ``docs`` (between its markers) with the folders' tables."""
    suites = [read_suite(f) for f in folders]
    if all(s["smoke"] for s in suites) and docs == DOCS:
        raise SuiteError("these are smoke runs (tiny model, CPU): they measure nothing; ingest a GPU run")
    block = f"{BEGIN}\n{summary_markdown(suites)}{END}"
    text = docs.read_text()
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n## GPU suite (`make gpu-suite`)\n\n" + block + "\n"
    tmp = docs.with_name(docs.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(docs)
    return block
