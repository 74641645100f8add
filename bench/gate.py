"""The latency regression gate: this run against a baseline record.

Two modes. ``absolute`` compares each (backend, model, batch) p50 with the baseline's: right for a
dedicated CI machine. ``ratio`` compares each (backend, batch) pruned/dense p50 speedup: both
models are measured interleaved in the same run, so a shared or throttled machine slows both and
the ratio holds; what it catches is the pruned model losing its advantage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.run import SCHEMA, SCHEMA_VERSION, pairs
from corp_deploy.errors import CorpError

MODES = ("absolute", "ratio")


@dataclass(frozen=True)
class Check:
    key: str
    baseline: float
    current: float
    change: float
    """Fractional change for the worse (+0.10 = 10% worse)."""
    regressed: bool


def parse_fraction(text: str) -> float:
    """``5%`` or ``0.05`` -> 0.05."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 10:
        raise CorpError(f"--max-regression takes a percentage such as 5% (or 0.05), got {text!r}")
    return value


def load_baseline(path: str | Path) -> dict[str, Any]:
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CorpError(
            f"baseline {path} does not exist; write one with `corp-deploy bench ... --json {path}`"
        ) from None
    except json.JSONDecodeError as e:
        raise CorpError(f"baseline {path} is not JSON ({e}); rewrite it with `corp-deploy bench --json`") from None
    if record.get("schema") != SCHEMA or record.get("schema_version", 0) > SCHEMA_VERSION:
        raise CorpError(f"baseline {path} is not a corp-deploy bench record this version reads")
    return record


def compare(current: dict[str, Any], baseline: dict[str, Any], max_regression: float, mode: str) -> list[Check]:
    """One check per measurement present in both records."""
    if mode not in MODES:
        raise CorpError(f"--gate must be one of {', '.join(MODES)}, got {mode!r}")
    checks = []
    if mode == "absolute":
        base = {(r["backend"], r["model"], r["batch"]): r["p50_ms"] for r in baseline["results"]}
        for r in current["results"]:
            key = (r["backend"], r["model"], r["batch"])
            if key in base:
                change = r["p50_ms"] / base[key] - 1
                name = f"{r['backend']} {r['model']} batch {r['batch']} p50 ms"
                checks.append(Check(name, base[key], r["p50_ms"], change, change > max_regression))
    else:
        base = {(p["backend"], p["batch"]): p["p50_speedup"] for p in pairs(baseline)}
        for p in pairs(current):
            key = (p["backend"], p["batch"])
            if key in base:
                change = base[key] / p["p50_speedup"] - 1
                name = f"{p['backend']} batch {p['batch']} pruned/dense p50 speedup"
                checks.append(Check(name, base[key], p["p50_speedup"], change, change > max_regression))
    if not checks:
        raise CorpError("the baseline shares no (backend, batch) measurement with this run; re-record the baseline")
    return checks


def format_checks(checks: list[Check], max_regression: float, mode: str) -> str:
    bad = [c for c in checks if c.regressed]
    head = f"regression gate ({mode}, max {max_regression:.1%}): {len(bad)} of {len(checks)} regressed"
    lines = [head]
    for c in bad or checks:
        mark = "REGRESSED" if c.regressed else "ok"
        direction = "worse" if c.change > 0 else "better"
        lines.append(
            f"  {mark:9s} {c.key}: baseline {c.baseline:.3f}, now {c.current:.3f} ({abs(c.change):.1%} {direction})"
        )
    return "\n".join(lines)
