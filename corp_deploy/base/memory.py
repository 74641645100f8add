"""Memory planned from the machine: what is available, what a run will hold, and the one line when it cannot fit.

A run's peak is predicted before the work from sizes alone (the weights as loaded, the statistics held at once, the
token cache, one batch's activations) and compared with what the machine has: ``/proc/meminfo``'s MemAvailable, the
cgroup's limit when one binds tighter, or ``CORP_DEPLOY_MEMORY_GIB`` (a forced value: tests, or a share of a machine
others use). A plan that does not fit says so in one line before anything is loaded or computed, naming what would
make it fit; one that fits is recorded (``Plan.to_dict``) beside the measured peak, so a user can compare them.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from corp_deploy.base.errors import CorpError

GIB = 2**30
ENV = "CORP_DEPLOY_MEMORY_GIB"
HEADROOM = 0.85
"""Share of the available memory a plan may use: the interpreter, torch's allocator caches and libraries' buffers are
not in the prediction. Judgement, from the 1.7B-shape runs (predicted vs measured peak RSS in docs/BENCHMARKS.md)."""


RUNTIME = 750 * 2**20
"""The interpreter with torch, transformers and corp-deploy imported, before any model: 749 MiB peak RSS measured
(2026-12-02, torch 2.14, transformers 5.24). Every plan holds it."""


EXPORT_COPIES = {"fp32": 1.1, "traced": 5.0, "genai": 1.35, "int4": 1.2}
"""An export's peak beside the interpreter, in multiples of the larger model's float32 weights (the dense one's): the
model held (``exporters.pipeline.OneAtATime``: one at a time) and what the exporters hold beside it.

- ``fp32``, weights of ``TRACED_BELOW`` and more: the logits graphs by dynamo with external data, the model let go
  before onnxruntime's session of the graph opens (``pipeline.export_verified``), so the model or the session is
  held, about one copy. Measured at 24 layers (the 1.7B shape, 6.75 GiB of weights), 2026-12-02, docs/BENCHMARKS.md
  "Scale": dense.onnx written and verified at 7.74 GiB peak RSS = the runtime and 1.04 copies (pruned.onnx, 5.41
  GiB: 6.38 GiB, 1.03 copies); 1.1 leaves room. Reading a prune artifact back (``load_pruned``) is not counted.
- ``traced``, weights under it: the TorchScript tracer holds its proto in memory, 5x (the 1.7B-wide shape cut to 2
  and 6 layers, 2026-12-02). A dense model at or over the limit whose pruned copy falls under it has its pruned graph
  traced: up to 5x of that copy, which this plan does not see.
- ``genai`` (a decoder's genai folders, after its ONNX graphs) and ``int4`` (its INT4 folders, after those): the
  lead's quiet run of the 1.7B shape, ``prune-export --precision fp32,int4`` (2026-12-02, d577522, docs/BENCHMARKS.md
  "Scale"; 6.75 GiB of float32 weights): **9.38 GiB for the process**, reached before the INT4 step (it sampled 8.40
  at most), likely where genai's builder reads the dense folder (9.09 in genai55's run: its own model and the graph it
  writes) with the torch model let go: (9.38 - 0.73) / 6.75 = 1.28, and 1.35 leaves room; the INT4 step (the
  ranking's FP32 onnxruntime session and its activations, one MatMul's weights at a time): (8.40 - 0.73) / 6.75 =
  1.14. A run's plan is its largest step's."""
TRACED_BELOW = 2 * GIB
"""``exporters.onnx_export.MAX_SINGLE_FILE``: the logits graphs of smaller models are traced (``base`` imports no
exporter)."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _meminfo() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_dirs(root: Path = CGROUP_ROOT, own: str | None = None) -> list[tuple[Path, str, str]]:
    """(folder, limit file, usage file) of this process's memory cgroup and every ancestor up to the root, v2 and
    v1: a limit set on a parent (a systemd slice, a container's) binds the children too. ``own``: the text of
    ``/proc/self/cgroup`` (read when None)."""
    if own is None:
        try:
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            own = ""
    found = []
    for line in own.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        folder = base / path.strip("/")
        while True:
            found.append((folder, *files))
            if folder == base:
                break
            folder = folder.parent
    v1 = (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")
    return found or [(root, "memory.max", "memory.current"), v1]


def _cgroup_room(dirs: list[tuple[Path, str, str]] | None = None) -> int | None:
    """The tightest room (limit minus usage) over this process's memory cgroups (``_cgroup_dirs``), when one sets a
    limit: the cgroup's own folder as a container mounts it, or its path under the hierarchy (a nested cgroup)."""
    rooms = []
    for folder, limit, usage in _cgroup_dirs() if dirs is None else dirs:
        try:
            cap, used = (folder / limit).read_text().strip(), int((folder / usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 2**60:
            rooms.append(max(0, int(cap) - used + _inactive_file(folder)))
    return min(rooms, default=None)


def _inactive_file(folder: Path) -> int:
    """Bytes of the cgroup's usage that are page cache nobody touched lately (``memory.stat``: v1's
    ``total_inactive_file``, v2's ``inactive_file``): the kernel reclaims them before it fails an allocation, so
    they are room (a model read from disk leaves its file's pages charged there: 6 GiB at the 1.7B shape)."""
    try:
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return 0
    return int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))


def available() -> int | None:
    """Bytes of host memory this process may still take (None when the machine does not say)."""
    forced = os.environ.get(ENV)
    if forced:
        try:
            return int(float(forced) * GIB)
        except ValueError:
            raise CorpError(f"{ENV}={forced!r} is not a number of GiB") from None
    found = [n for n in (_meminfo(), _cgroup_room()) if n is not None]
    return min(found) if found else None


def safetensors_bytes(folder: str | Path, itemsize: int | None = None) -> int:
    """Bytes of a folder's safetensors weights, read from the files' headers (nothing loaded); ``itemsize``: as
    loaded in that many bytes per element (4: float32) instead of as stored."""
    sizes = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}
    total = 0
    for path in Path(folder).glob("*.safetensors"):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in entry["shape"]:
                count *= d
            total += count * (itemsize or sizes.get(entry["dtype"], 4))
    return total


@dataclass(frozen=True)
class Plan:
    """What a run will hold at its peak, by part (bytes), against what the machine has."""

    parts: dict[str, int]
    available: int | None
    device: str = "host"

    @property
    def peak(self) -> int:
        return RUNTIME + sum(self.parts.values())

    def fits(self) -> bool:
        return self.available is None or self.peak <= HEADROOM * self.available

    def check(self, fixes: str) -> Plan:
        """This plan, or the one line that says it cannot fit and what would make it (``fixes``)."""
        if not self.fits():
            held = ", ".join(f"{k} {gib(v)}" for k, v in {"runtime": RUNTIME, **self.parts}.items() if v)
            raise CorpError(
                f"this run needs about {gib(self.peak)} of {self.device} memory ({held}) and "
                f"{gib(self.available or 0)} is available; {fixes}"
            )
        return self

    def to_dict(self) -> dict[str, float | str | None]:
        """The prediction as ``corp.json`` records it (GiB), beside the measured peak."""
        parts = {f"{k}_gib": v / GIB for k, v in self.parts.items()}
        room = None if self.available is None else self.available / GIB
        return {
            "device": self.device,
            "peak_gib": self.peak / GIB,
            "available_gib": room,
            "runtime_gib": RUNTIME / GIB,
            **parts,
        }


def export_plan(weights: int, available: int | None, int4: bool = False, decoder: bool = False) -> Plan:
    """The peak of exporting a model of ``weights`` bytes of float32 weights and its pruned copy (never larger), one
    at a time (``EXPORT_COPIES``: the largest step's; ``decoder``: with genai folders, ``int4``: with INT4 folders).
    The prune and its save before it hold less: an onloaded prune's peak is its walk's (``blockwise.memory_plan``), and
    its save streams the pruned blocks."""
    steps = [EXPORT_COPIES["fp32" if weights >= TRACED_BELOW else "traced"]]
    steps += [EXPORT_COPIES["genai"]] if decoder else []
    steps += [EXPORT_COPIES["int4"]] if int4 else []
    return Plan({"model": weights, "exporters": round((max(steps) - 1) * weights)}, available)
