"""Calibration time with 1 process and with N torchrun processes on the same images (make bench-dist).

    python -m studies.dist_scaling deit_small --num-calib 128 --procs 2

Runs ``corp-deploy prune`` (random weights, noise images, CPU) once alone and once under
``torchrun --nproc-per-node N`` with the machine's cores split between the ranks, and reads the
calibration seconds, the all-reduce volume (the statistics' size) and the peak memory from each
artifact's ``corp.json``. Both runs see the same images, so the artifacts must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def prune(model: str, num: int, out: Path, procs: int) -> dict:
    cores = os.cpu_count() or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // procs))}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    cmd = [*(launch if procs > 1 else [sys.executable]), "-m", "corp_deploy", "prune", model, "--weights", "random"]
    cmd += ["--calib", "synthetic", "--num-calib", str(num), "--device", "cpu", "--quiet", "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return json.loads((out / "corp.json").read_text())["report"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="deit_small")
    p.add_argument("--num-calib", type=int, default=128)
    p.add_argument("--procs", type=int, default=2)
    a = p.parse_args()
    print("| processes | threads each | calibration s | images/s | all-reduce MiB (statistics) | rank-0 peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for procs in (1, a.procs):
            r = prune(a.model, a.num_calib, Path(tmp) / f"p{procs}", procs)
            seconds = r["seconds"]["calibration"]
            print(
                f"| {procs} | {max(1, (os.cpu_count() or 1) // procs)} | {seconds:.1f} | "
                f"{r['calibration']['images'] / seconds:.1f} | {r['memory']['statistics_mib']:.0f} | "
                f"{r['memory']['host_rss_mib']:.0f} |"
            )


if __name__ == "__main__":
    main()
