"""Running the suite: arguments, the section loop, and the three files it writes."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from corp_deploy.base.errors import first_line
from tools.gpu_suite import __doc__ as DOC
from tools.gpu_suite.core import SCHEMA, SCHEMA_VERSION, Context, Plan, SuiteError, environment, write_json
from tools.gpu_suite.record import ingest, summary_markdown
from tools.gpu_suite.registry import SECTIONS
from tools.gpu_suite.wheels import activate


def run_suite(
    out: Path, device: torch.device, only: list[str], plan: Plan, smoke: bool, budget: float, command: str
) -> dict:
    """Run the sections in ``only``; write suite.json after each, then summary.md."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with (out / "suite.log").open("w") as log_file:

        def log(line: str) -> None:
            print(line, flush=True)
            log_file.write(line.rstrip("\n") + "\n")
            log_file.flush()

        carried = [] if smoke else activate()  # smoke runs check code paths with what is installed
        ctx = Context(device, plan, smoke, start + budget, log)
        suite: dict[str, Any] = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "smoke": smoke,
            "environment": environment(device) | {"carried_wheels": carried},
            "plan": asdict(ctx.plan),
            "sections": [],
            "records": {},
        }
        log(f"gpu-suite on {suite['environment'].get('gpu', 'the CPU')}: {', '.join(only)}; carried: {carried}")
        for name in only:
            entry: dict[str, Any] = {"name": name, "status": "ok"}
            t0 = time.perf_counter()
            if ctx.time_left() < 0:
                entry |= {"status": "skipped", "error": "time budget spent"}
            else:
                log(f"== {name}")
                try:
                    record = suite["records"][name] = SECTIONS[name].run(ctx)
                    if record.get("error"):
                        entry |= {"status": "failed", "error": record["error"]}
                except Exception as e:  # each section fails alone; the traceback is in the log
                    log(traceback.format_exc())
                    entry |= {"status": "failed", "error": f"{type(e).__name__}: {first_line(e)[:300]}"}
            entry["seconds"] = time.perf_counter() - t0
            log(f"== {name}: {entry['status']} in {entry['seconds']:.1f} s {entry.get('error', '')}")
            suite["sections"].append(entry)
            suite["seconds"] = time.perf_counter() - start
            write_json(out / "suite.json", suite)
        (out / "summary.md").write_text(summary_markdown([suite]))
    return suite


def narrow(plan: Plan, models: str | None, precisions: str | None) -> Plan:
    """The plan restricted to some models and precisions, so that a short call measures what matters."""
    changes: dict = {}
    if models:
        names = [m.strip() for m in models.split(",") if m.strip()]
        if not names or any(m not in plan.models for m in names):
            raise SuiteError(f"--models takes names from {', '.join(plan.models)}, got {models!r}")
        changes["models"] = {m: plan.models[m] for m in names}
        changes["sdpa_shapes"] = {k: v for k, v in plan.sdpa_shapes.items() if k in names} or plan.sdpa_shapes
        if plan.profile[0] not in names:
            changes["profile"] = (names[0], *plan.profile[1:])
    if precisions:
        names = [p.strip() for p in precisions.split(",") if p.strip()]
        if not names or any(p not in plan.precisions for p in names):
            raise SuiteError(f"--precisions takes names from {', '.join(plan.precisions)}, got {precisions!r}")
        changes["precisions"] = tuple(names)
        changes["compile_precisions"] = tuple(p for p in plan.compile_precisions if p in names)
    return replace(plan, **changes)


def parse_only(text: str | None) -> list[str]:
    if not text:
        return list(SECTIONS)
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise SuiteError(f"unknown section {', '.join(unknown) or repr(text)}; choose from {', '.join(SECTIONS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.gpu_suite", description=DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, help="folder for the records (must not exist, unless --overwrite)")
    p.add_argument("--only", help=f"comma list of sections: {', '.join(SECTIONS)}")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu with --smoke")
    p.add_argument("--smoke", action="store_true", help="tiny model and few iterations: checks every code path")
    p.add_argument("--models", help="comma list: only these of the plan's models (e.g. deit_base)")
    p.add_argument("--precisions", help="comma list: only these latency precisions (fp32,tf32,fp16,bf16)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds after which no new measurement starts")
    p.add_argument("--overwrite", action="store_true", help="write into an existing --out")
    p.add_argument("--ingest", type=Path, nargs="+", metavar="DIR", help="write these runs into docs/BENCHMARKS.md")
    a = p.parse_args(argv)
    try:
        if a.ingest:
            print(ingest(a.ingest))
            return 0
        if a.out is None:
            raise SuiteError("pass --out DIR to run the suite, or --ingest DIR to fold a run into the docs")
        only = parse_only(a.only)
        plan = narrow(Plan.smoke() if a.smoke else Plan.full(), a.models, a.precisions)
        if a.device != "cpu" and not a.device.startswith("cuda"):
            raise SuiteError(f"--device must be cuda or cpu, got {a.device!r}")
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise SuiteError("--device cuda, but no CUDA GPU is visible; on a CPU machine run --smoke --device cpu")
        if a.device == "cpu" and not a.smoke:
            raise SuiteError("--device cpu measures nothing worth recording; add --smoke (CI) or run on a GPU")
        if a.out.exists() and (not a.out.is_dir() or any(a.out.iterdir())) and not a.overwrite:
            raise SuiteError(f"{a.out} exists; choose another --out or pass --overwrite")
        command = "python -m tools.gpu_suite " + " ".join(sys.argv[1:] if argv is None else argv)
        suite = run_suite(a.out, torch.device(a.device), only, plan, a.smoke, a.budget, command)
    except SuiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = [s["name"] for s in suite["sections"] if s["status"] != "ok"]
    print(f"gpu-suite: {len(suite['sections']) - len(failed)} sections ok, not ok: {', '.join(failed) or 'none'}")
    print(f"records in {a.out}; fold them into the docs with: python -m tools.gpu_suite --ingest {a.out}")
    return 1 if failed else 0
