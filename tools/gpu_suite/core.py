"""What every section shares: the plan (full or smoke), the run context, models and timing."""

from __future__ import annotations

import copy
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from corp_deploy.base.env import module_versions

SCHEMA = "corp-deploy/gpu-suite"
SCHEMA_VERSION = 2
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Plan:
    """What each section measures: the full GPU plan, or the smoke plan (tiny model, CPU, seconds)."""

    models: dict[str, dict[str, Any]]
    """Model name -> timm arguments."""
    prune_images: int
    calib_batch: int
    latency_images: int
    """Calibration images for the latency section's pruned models (latency does not depend on them)."""
    batches: tuple[int, ...]
    precisions: tuple[str, ...]
    compile_precisions: tuple[str, ...]
    compile_batches: tuple[int, ...]
    compile_backend: str
    sdpa_shapes: dict[str, tuple[int, int, int, int]]
    """Label -> (batch, heads, tokens, head dim)."""
    sdpa_precisions: tuple[str, ...]
    profile: tuple[str, str, int]
    """(model, precision, batch) whose kernel time the ``profile`` section splits by kind."""
    speedup: tuple[str, str, tuple[tuple[int, float], ...]]
    """(model, latency backend, ((batch, speedup goal), ...)) of the ``speedup`` section."""
    warmup_seconds: float
    min_seconds: float
    min_iters: int
    pytest_args: tuple[str, ...]

    @classmethod
    def full(cls) -> Plan:
        return cls(
            models={"deit_small": {}, "deit_base": {}},
            prune_images=4000,
            calib_batch=128,
            latency_images=128,
            batches=(1, 8, 64, 256),
            precisions=("fp32", "tf32", "fp16", "bf16"),
            compile_precisions=("fp16",),
            compile_batches=(1, 64),
            compile_backend="inductor",
            sdpa_shapes={"deit_small": (64, 6, 197, 64), "deit_base": (64, 12, 197, 64)},
            sdpa_precisions=("fp32", "fp16", "bf16"),
            profile=("deit_base", "fp16", 64),
            speedup=("deit_base", "torch-cuda-fp16-graph", ((64, 1.65), (1, 1.25))),  # batch 1: p50 ratio <= 0.8
            warmup_seconds=0.3,
            min_seconds=0.5,
            min_iters=20,
            pytest_args=("-m", "gpu"),
        )

    @classmethod
    def smoke(cls) -> Plan:
        tiny = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4, "mlp_ratio": 2.0}
        return cls(
            models={"deit_tiny": tiny},
            prune_images=16,
            calib_batch=8,
            latency_images=8,
            batches=(1, 2),
            precisions=("fp32", "bf16"),
            compile_precisions=("fp32",),
            compile_batches=(1,),
            compile_backend="eager",  # exercises dynamo without a C++ toolchain or minutes of compiling
            sdpa_shapes={"tiny": (2, 2, 17, 16)},
            sdpa_precisions=("fp32",),
            profile=("deit_tiny", "fp32", 2),
            speedup=("deit_tiny", "torch-cpu-fp32", ((2, 1.2), (1, 1.2))),
            warmup_seconds=0.0,
            min_seconds=0.0,
            min_iters=3,
            pytest_args=("-m", "gpu", "tests/house/test_gpu.py"),
        )


@dataclass
class Context:
    """One run of the suite: what it measures, where, and how long it may still take."""

    device: torch.device
    plan: Plan
    smoke: bool
    deadline: float
    """perf_counter time after which no new measurement starts."""
    log: Callable[[str], None]
    pruned: dict[str, nn.Module] = field(default_factory=dict)
    """Pruned models shared between sections run in the same process (CPU copies)."""

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()


class SuiteError(Exception):
    """Bad input to the suite: one line, exit 2."""


def environment(device: torch.device) -> dict[str, Any]:
    from corp_deploy.bench.run import environment as bench_environment

    env = bench_environment(torch.get_num_threads()) | {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    packages = ("timm", "onnx", "onnxscript", "triton", "numpy")
    env |= {name: "not installed" for name in packages} | module_versions(packages)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {
            "compute_capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "cudnn": torch.backends.cudnn.version(),
        }
    return env


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def precision_mode(precision: str) -> Any:
    """TF32 matmuls and convolutions on for ``tf32`` only: plain fp32 is exact fp32."""

    @contextmanager
    def mode():
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

    return mode()


def create(name: str, args: dict[str, Any]) -> nn.Module:
    import corp_deploy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights and noise calibration, on purpose
        return corp_deploy.create_model(name, weights="random", model_args=args)


PRUNED = {"pruned": "both", "pruned_v": "all"}
"""The pruned variants the latency section times beside dense: 50% MLP + Q/K (V and proj dense), and
50% MLP + Q/K + V (equal Q/K and V head widths: fused attention applies again)."""


def prune(ctx: Context, name: str, images: int, target: str = "both") -> tuple[nn.Module, dict[str, Any]]:
    import corp_deploy

    model = create(name, ctx.plan.models[name])
    config = corp_deploy.PruneConfig(sparsity=0.5, target=target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches, total = corp_deploy.calibration_batches(model, "synthetic", images, ctx.plan.calib_batch)
        result = corp_deploy.prune(model, batches, config, ctx.device, total, False)
    return result.model, result.report


def pruned_model(ctx: Context, name: str, variant: str = "pruned") -> nn.Module:
    """The model pruned by the ``prune`` section when it ran, else pruned here on a few noise images."""
    key = name if variant == "pruned" else f"{name}:{variant}"
    if key not in ctx.pruned:
        ctx.pruned[key] = prune(ctx, name, ctx.plan.latency_images, PRUNED[variant])[0].cpu()
    return ctx.pruned[key]


def on_device(ctx: Context, models: dict[str, nn.Module], precision: str) -> dict[str, nn.Module]:
    """Copies of ``models`` on the suite's device in ``precision``, in eval mode."""
    return {k: copy.deepcopy(m).to(ctx.device, DTYPES[precision]).eval() for k, m in models.items()}


def warm_device(ctx: Context) -> None:
    """Create the CUDA context and cuBLAS handles outside any timed region."""
    x = torch.randn(256, 256, device=ctx.device)
    (x @ x).sum().item()


def step(ctx: Context, call: Callable[[], object]) -> Callable[[], float]:
    from corp_deploy.bench.backends import cpu_step, cuda_step

    return cuda_step(call) if ctx.device.type == "cuda" else cpu_step(call)


def measure(ctx: Context, calls: dict[str, Callable[[], object]], batch: int) -> dict[str, dict[str, float]]:
    """Interleaved timing of named calls (same run, alternating rounds); summary statistics per call."""
    from corp_deploy.base.timing import Method, interleaved, summarize

    method = Method(
        warmup_iters=3 if ctx.smoke else 10,
        warmup_seconds=ctx.plan.warmup_seconds,
        min_iters=ctx.plan.min_iters,
        min_seconds=ctx.plan.min_seconds,
    )
    times = interleaved({k: step(ctx, c) for k, c in calls.items()}, method)
    return {k: asdict(summarize(v, batch)) for k, v in times.items()}
