"""The closed loop run again and again: how far apart its measured speedups land, and how often it is met.

    python -m studies.loop_band --runs 10 --json loop-band.json      # issue 23's done-means command, 10 times
    python -m studies.loop_band --runs 3 -- prune-export deit_small --weights random --calib synthetic \\
        --speedup 2 --latency-on torch-cpu-fp32 --latency-batch-size 32 --precision fp32

One ``prune-export`` with a latency budget times dense and pruned once and says met or missed within its own
noise band; that band is one run's. Running the same command N times (the latency table measured by the first
and reused from the cache by the others, as a user's repeated runs would) gives the spread across whole loops:
the median and quartiles of the final measured speedups, how many met their target, and the rounds they took.
Each run's folder is written to a temporary directory and deleted once its ``corp.json`` is read. Run it on a
quiet machine: on a loaded one the spread is the load's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from corp_deploy.base.env import cpu_model

DONE_MEANS = "prune-export deit_small --weights random --calib synthetic --speedup 2 --latency-on ort-cpu-fp32 "
DONE_MEANS += "--latency-batch-size 32"


def run_once(command: list[str], out: Path) -> dict[str, Any]:
    """``corp-deploy COMMAND --out OUT`` in a fresh process, as a user runs it; the closed loop's record from its
    ``corp.json``."""
    done = subprocess.run([sys.executable, "-m", "corp_deploy", *command, "--out", str(out)], check=False)
    if done.returncode:
        raise SystemExit(f"run failed (exit {done.returncode}): corp-deploy {' '.join(command)}")
    report = json.loads((out / "pruned" / "corp.json").read_text())["report"]
    if "latency" not in report:
        raise SystemExit("the command ran no closed loop: give prune-export a --speedup and --latency-on")
    return report["latency"]


def band(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """The spread of the final measured speedups over runs, and the verdicts."""
    measured = np.array([c["measured_speedup"] for c in checks])
    q1, median, q3 = np.percentile(measured, [25, 50, 75])
    return {
        "runs": len(checks),
        "target": checks[0]["target_speedup"],
        "median": float(median),
        "q1": float(q1),
        "q3": float(q3),
        "half_iqr_rel": float((q3 - q1) / 2 / median),
        "min": float(measured.min()),
        "max": float(measured.max()),
        "met": sum(bool(c["met"]) for c in checks),
        "rounds": [c["rounds"] for c in checks],
        "own_bands": [c["spread"] for c in checks],
        "measured": measured.tolist(),
    }


def row(command: str, b: dict[str, Any]) -> str:
    """One markdown row for docs/BENCHMARKS.md "Prune to a speed"."""
    return (
        f"| {datetime.date.today()} | {cpu_model()} | `{command}` | {b['runs']} | {b['target']:.2f}x "
        f"| {b['median']:.2f}x ({b['q1']:.2f}-{b['q3']:.2f}; +-{b['half_iqr_rel']:.1%}) "
        f"| {b['min']:.2f}-{b['max']:.2f}x | {b['met']}/{b['runs']} | {np.mean(b['rounds']):.1f} |"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--json", help="write every run's record and the band here")
    p.add_argument("command", nargs=argparse.REMAINDER, help=f"after --: the command [{DONE_MEANS}]")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be >= 1")
    command = [c for c in a.command if c != "--"] or DONE_MEANS.split()
    checks = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="corp-loop-band-") as tmp:
            checks.append(run_once(command, Path(tmp) / "run"))
        c = checks[-1]
        print(
            f"run {i + 1}/{a.runs}: measured {c['measured_speedup']:.3f}x +-{c['spread']:.1%} "
            f"(predicted {c['predicted_speedup']:.3f}x, {c['rounds']} rounds): {'met' if c['met'] else 'MISSED'}",
            flush=True,
        )
    b = band(checks)
    print("| date | cpu | command | runs | target | median (quartiles; half IQR) | range | met | mean rounds |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(row(" ".join(command), b))
    if a.json:
        Path(a.json).write_text(json.dumps({"command": command, "band": b, "runs": checks}, indent=2) + "\n")


if __name__ == "__main__":
    main()
