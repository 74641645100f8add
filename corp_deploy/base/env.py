"""The machine and the software a record was made with: one collector behind every record that names them.

``corp.json`` and ``export.json`` (``versions``), engine sidecars (``gpu``), bench records
(``environment``), pruning reports (``device_name``) and the GPU suite all read these functions, so
a key means the same wherever it is written. torch, timm and the optional packages are imported
when a function runs, not when this module is imported: it is a room that imports nothing heavy.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from corp_deploy.base.deps import optional
from corp_deploy.base.version import __version__


def cpu_name() -> str:
    return platform.processor() or platform.machine()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``) where the OS tells it, else ``cpu_name``: what a CPU latency
    table is tied to (``platform.processor`` is often just the architecture)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return cpu_name()


CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
"""The x86 features onnxruntime's INT8 kernels dispatch on (VNNI dot products, AMX tiles): an INT8 speed figure
means little without them."""


def cpu_features() -> dict[str, Any]:
    """The CPU's model and which of ``CPU_FLAGS`` it has (``/proc/cpuinfo``); ``flags`` is None where the OS does not
    say (not Linux): unknown, not absent."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
        flags: list[str] | None = [f for f in CPU_FLAGS if f in line.partition(":")[2].split()]
    except (OSError, StopIteration):
        flags = None
    return {"model": cpu_model(), "flags": flags, "cores": os.cpu_count()}


def describe_cpu(features: dict[str, Any]) -> str:
    """``cpu_features`` in words: ``AMD EPYC (avx2, avx512f, avx512_vnni)``."""
    flags = features["flags"]
    return f"{features['model']} ({'flags unknown' if flags is None else ', '.join(flags) or 'no AVX2, AVX-512, AMX'})"


def device_name(device: Any) -> str:
    """``cuda (<GPU>)`` or ``cpu (<processor>, <n> threads)``: where a pruning run computed."""
    import torch

    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({cpu_name()}, {torch.get_num_threads()} threads)"


def versions() -> dict[str, str]:
    """The software an artifact was made with (``corp.json``, ``export.json``); timm's version is read from its
    installed metadata, not by importing it (a text model's run never imports timm)."""
    from importlib.metadata import version

    import torch

    return {
        "corp_deploy": __version__,
        "torch": torch.__version__,
        "timm": version("timm"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda or "none",
    }


def gpu() -> dict[str, str]:
    """The current CUDA GPU, as engine sidecars name it (the GPU a TensorRT engine is tied to)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return {
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "cuda": torch.version.cuda or "unknown",
    }


def module_versions(modules: Iterable[str]) -> dict[str, str]:
    """``__version__`` of each module that imports here; absent ones are left out."""
    found = {name: optional(name) for name in modules}
    return {name: module.__version__ for name, module in found.items() if module is not None}


def driver_version() -> str:
    """The NVIDIA driver's version (``nvidia-smi``), or ``unknown``."""
    if not shutil.which("nvidia-smi"):
        return "unknown"
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    )
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def environment(threads: int, gpu_modules: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything a latency number depends on that is not in the model.

    ``gpu_modules`` (record key -> import name, e.g. the TensorRT flavours) are recorded with a GPU.
    """
    import torch

    env: dict[str, Any] = {
        "cpu": cpu_name(),
        "cpu_features": cpu_features(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corp_deploy": __version__,
        **module_versions(["onnxruntime"]),
    }
    if torch.cuda.is_available():
        env |= {
            "gpu": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda,
            "driver": driver_version(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        }
        installed = module_versions((gpu_modules or {}).values())
        env |= {key: installed[module] for key, module in (gpu_modules or {}).items() if module in installed}
    return env


@contextmanager
def exact_fp32() -> Iterator[None]:
    """FP32 math as written inside the block: no TF32 (nor bfloat16) matmuls or convolutions in torch.

    torch lets float32 matmuls run in TF32 (10-bit mantissa) on Ampere and later GPUs when
    ``torch.backends.cuda.matmul.allow_tf32`` or ``set_float32_matmul_precision("high")`` says so,
    and cuDNN convolutions when ``torch.backends.cudnn.allow_tf32`` does (on by default); "medium"
    allows bfloat16 (also oneDNN's on CPUs). A reference computed that way blames its own rounding
    on the graph or engine verified against it, and calibration sums computed that way carry ~1e-3
    relative error into Q/K systems with condition numbers of 1e10 and more (SparseGPT turns TF32 off
    too). All three are turned off and restored on exit, also on an exception: the flags first, then the
    precision, which would otherwise leave torch >= 2.9 (it maps both onto newer per-backend settings) in
    a mixed state it refuses to read back.
    """
    import torch

    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # already mixed through torch's newer API: unreadable, so the flags alone are restored
        precision = None
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        if precision is not None:
            torch.set_float32_matmul_precision(precision)
