"""Wheels the GPU image lacks, carried in ``.gpu-wheels/`` (git-ignored) and installed for one run.

    make gpu-wheels       # here (PyPI reachable): python -m tools.gpu_suite.wheels download

The GPU machine has no network and takes at most 64 MiB of working tree per call. What it lacks:
``onnxconverter-common`` (FP16 ONNX; pure Python, 90 kB) and TensorRT-RTX: its bindings (1.2 MB)
and its libraries, a 95 MB wheel holding a 234 MB ``libtensorrt_rtx.so.1``. That library is
recompressed with xz (62 MiB) and split into ``part-a/`` and ``part-b/`` (31 MiB each), so it
travels in two consecutive calls to the same warm machine:

    call 1: carry .gpu-wheels/wheels and .gpu-wheels/part-a;
            python -m tools.gpu_suite.wheels stash && make gpu-suite GPU_OUT=$OUT/gpu
    call 2, at once (before the machine is given back): carry .gpu-wheels/wheels and .gpu-wheels/part-b;
            make gpu-suite ONLY=engines GPU_OUT=$OUT/engines

``stash`` copies part-a to a folder outside the working tree, where call 2 finds it. Without
both parts the suite runs without TensorRT-RTX and its ``engines`` section says so.
"""

from __future__ import annotations

import atexit
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / ".gpu-wheels"
STASH = Path(tempfile.gettempdir()) / "corp-deploy-gpu-wheels"
PLAIN = ("onnxconverter-common==1.16.0", "tensorrt-rtx-cu13-bindings==1.7.1.116")
RTX_LIBS = "tensorrt-rtx-cu13-libs==1.7.1.116"
MAIN_LIB = "libtensorrt_rtx.so.1"
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
PLATFORM += [
    a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64") for a in ("--platform", p)
]


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, capture_output=args[0] == "install")


def download(root: Path = ROOT) -> None:
    """Fetch the wheels for the GPU image (cp312, x86-64) and repack TensorRT-RTX's libraries in two parts."""
    wheels, work = root / "wheels", Path(tempfile.mkdtemp())
    _pip("download", "--no-deps", *PLATFORM, "-d", str(wheels), *PLAIN)
    _pip("download", "--no-deps", *PLATFORM, "-d", str(work), RTX_LIBS)
    libs = zipfile.ZipFile(next(work.glob("*.whl")))
    packed = lzma.compress(libs.read(f"tensorrt_rtx_libs/{MAIN_LIB}"), preset=9 | lzma.PRESET_EXTREME)
    half = len(packed) // 2
    for name, chunk in (("part-a", packed[:half]), ("part-b", packed[half:])):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / f"{MAIN_LIB}.xz.{name}").write_bytes(chunk)
    for member in libs.namelist():  # the small files ride with part-b
        if member.startswith("tensorrt_rtx_libs/") and not member.endswith(MAIN_LIB):
            (root / "part-b" / Path(member).name).write_bytes(libs.read(member))
    shutil.rmtree(work)
    print(f"wheels in {root}: " + ", ".join(str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()))


def stash(root: Path = ROOT) -> None:
    """Keep part-a outside the working tree, for the next call on the same machine."""
    STASH.mkdir(parents=True, exist_ok=True)
    for f in (root / "part-a").glob("*"):
        shutil.copy(f, STASH / f.name)


def activate(root: Path = ROOT) -> list[str]:
    """Install what was carried into a temporary folder and put it on this process's and children's path."""
    wheels = sorted((root / "wheels").glob("*.whl"))
    part_a, part_b = (
        next((f for d in (root / p, STASH) for f in d.glob(f"{MAIN_LIB}.xz.{p}")), None) for p in ("part-a", "part-b")
    )
    if not wheels and not (part_a and part_b):
        return []
    target = Path(tempfile.mkdtemp(prefix="corp-deploy-site-"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    carried = []
    for wheel in wheels:  # one by one: a wheel for another interpreter (cp312 here on 3.11) is skipped, said
        try:
            _pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(target), str(wheel))
            carried.append(wheel.name)
        except subprocess.CalledProcessError:
            carried.append(f"{wheel.name} (not installable for this Python: skipped)")
    if part_a and part_b:
        libs = target / "tensorrt_rtx_libs"
        libs.mkdir()
        (libs / MAIN_LIB).write_bytes(lzma.decompress(part_a.read_bytes() + part_b.read_bytes()))
        for f in part_b.parent.iterdir():
            if f != part_b:
                shutil.copy(f, libs / f.name)
        carried.append(f"{RTX_LIBS} (repacked)")
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    return carried


if __name__ == "__main__":
    commands = {"download": download, "stash": stash}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python -m tools.gpu_suite.wheels {{{'|'.join(commands)}}}")
    commands[sys.argv[1]]()
