"""The latency regression gate: this run against a baseline record.

Three modes. ``absolute`` compares each (backend, model, batch) p50 with the baseline's: right for a
dedicated CI machine. ``ratio`` compares each (backend, batch) pruned/dense p50 speedup: both
models are measured interleaved in the same run, so a shared or throttled machine slows both and
the ratio holds; what it catches is the pruned model losing its advantage. ``quantize-only`` needs no baseline
record: in this run, pruned INT8 (a decoder's INT4) against the dense model quantized the runtime's own way
(``bench.baseline``; a decoder's ``bench.decode.quantize_only``), timed in the same loop; pruned slower than it by
more than the limit fails (``--max-regression 0``: it must win).

A change equal to the limit passes ("beyond 5%" fails); every baseline measurement must be in this
run, since a gate that quietly checks less is no gate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corp_deploy.base.errors import CorpError
from corp_deploy.bench.run import SCHEMA, SCHEMA_VERSION, label, measurement, pairs
from corp_deploy.formats.run_folder import BASELINE_GENAI

BASELINE_MODES = ("absolute", "ratio")
"""The gates that compare this run with a baseline record."""
QUANTIZE_ONLY = "quantize-only"
MODES = (*BASELINE_MODES, QUANTIZE_ONLY)
TIE = 1e-9
"""Changes this close to the limit equal it: 10 -> 10.5 ms is 5%, not float division's 5.0000000000000044%."""


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
    if (
        not isinstance(record, dict)
        or record.get("schema") != SCHEMA
        or record.get("schema_version", 0) > SCHEMA_VERSION
    ):
        raise CorpError(f"baseline {path} is not a corp-deploy bench record this version reads")
    results = record.get("results")
    if not isinstance(results, list) or not results:
        raise CorpError(f"baseline {path} holds no measurements; re-record it with `corp-deploy bench --json`")
    for i, r in enumerate(results):
        if not (isinstance(r, dict) and {"backend", "model", "batch"} <= r.keys() and _positive(r.get("p50_ms"))):
            raise CorpError(
                f"baseline {path}: measurement {i} lacks backend, model, batch or a positive p50_ms; "
                "re-record it with `corp-deploy bench --json`"
            )
    return record


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def regressed(change: float, limit: float) -> bool:
    """Worse by more than ``limit`` (a fraction); a change equal to it passes."""
    return change > limit + TIE


def compare(current: dict[str, Any], baseline: dict[str, Any], max_regression: float, mode: str) -> list[Check]:
    """One check per baseline measurement; this run must hold every one of them."""
    if mode not in BASELINE_MODES:
        raise CorpError(f"a baseline record is compared with --gate absolute or ratio, got {mode!r}")
    if mode == "absolute":  # keyed (model, backend, batch[, phase, prompt length]): a decoder's phases apart
        base = {(r["model"], *measurement(r)): r["p50_ms"] for r in baseline["results"]}
        now = {(r["model"], *measurement(r)): r["p50_ms"] for r in current["results"]}
    else:
        base = {measurement(p): p["p50_speedup"] for p in pairs(baseline)}
        now = {measurement(p): p["p50_speedup"] for p in pairs(current)}
    missing = [_label(key, mode) for key in base if key not in now]
    if missing:
        raise CorpError(
            f"this run lacks {len(missing)} of the baseline's {len(base)} measurements "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            "measure the same backends and batch sizes, or re-record the baseline"
        )
    checks = []
    for key, reference in base.items():
        # p50 latency: higher is worse; speedup: lower is worse.
        change = now[key] / reference - 1 if mode == "absolute" else reference / now[key] - 1
        checks.append(Check(_label(key, mode), reference, now[key], change, regressed(change, max_regression)))
    return checks


def _label(key: tuple, mode: str) -> str:
    """``ort pruned batch 1 p50 ms`` (absolute) or ``ort batch 1 pruned/dense p50 speedup`` (ratio)."""
    if mode == "absolute":
        model, backend, *rest = key
        return label((f"{backend} {model}", *rest)) + " p50 ms"
    return label(key) + " pruned/dense p50 speedup"


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


def against_quantize_only(record: dict[str, Any], max_regression: float) -> list[Check]:
    """One check per (backend, batch[, phase, prompt]) of this run timed beside the quantize-only baseline: pruned's
    p50 against the baseline's (``current`` pruned, ``baseline`` the baseline's p50). The baseline is timed where it
    has a precision to match: INT8 for encoders and images (``quantize_dynamic``), INT4 for decoders (genai's
    builder ``-p int4``)."""
    rows = [p for p in pairs(record) if "baseline_p50_ms" in p]
    if not rows:
        raise CorpError(
            "--gate quantize-only needs pruned INT8 or INT4 timed beside the quantize-only baseline: run ort-cpu-int8 "
            "on a folder with pruned.int8.onnx (prune-export --precision fp32,int8, or corp-deploy quantize), or "
            "genai-cpu-int4 on a "
            f"decoder run with {BASELINE_GENAI}/ (prune-export --precision int4)"
        )
    checks = []
    for p in rows:
        change = p["pruned_p50_ms"] / p["baseline_p50_ms"] - 1
        key = label(measurement(p)) + " pruned vs quantize-only baseline p50 ms"
        checks.append(Check(key, p["baseline_p50_ms"], p["pruned_p50_ms"], change, regressed(change, max_regression)))
    return checks
