"""Runners: one model on one backend, called with a numpy batch (``compare.Feed``), returning FP32 numpy.

Loaders, runners and comparators are separate pieces (as in Polygraphy): ``compare.verify`` takes
any two runners. The TensorRT runner lives in ``corp_deploy.exporters.tensorrt_engine``.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.exporters.compare import Feed, Runner
from corp_deploy.exporters.onnx_export import image_graph, load_onnx

ORT_PURPOSE = "running ONNX graphs"
GPU_PROVIDERS = ("CUDAExecutionProvider",)
"""onnxruntime's GPU backend is its CUDA provider, named explicitly: its TensorRT provider (first in
onnxruntime-gpu's list) would make ``ort-cuda`` a TensorRT benchmark and compare our engines with
TensorRT instead of an independent reference."""
PROVIDER_OPTIONS = {"CUDAExecutionProvider": {"use_tf32": "0"}}
"""FP32 means FP32: onnxruntime's CUDA provider runs FP32 matmuls in TF32 unless told not to (10-bit mantissa:
an FP32 reference or an FP32 latency would silently be neither)."""


class TorchRunner:
    """A PyTorch module on ``device`` in ``dtype`` (inputs cast in, outputs cast back to FP32)."""

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.model = image_graph(model.to(device=device, dtype=dtype).eval())  # what the exported graph computes
        self.device, self.dtype = torch.device(device), dtype
        self.name = f"torch-{self.device.type}-{str(dtype).removeprefix('torch.')}"

    @torch.inference_mode()
    def __call__(self, x: Feed) -> np.ndarray:
        if isinstance(x, dict):  # token ids and masks keep their integer type
            out = self.model(**{name: torch.from_numpy(a).to(self.device) for name, a in x.items()})
        else:
            out = self.model(torch.from_numpy(x).to(self.device, self.dtype))
        return out.float().cpu().numpy()


def ort_providers(device: str = "auto") -> tuple[list[str], str]:
    """Execution providers to ask for, best first, and a line saying why.

    ``auto`` takes the GPU providers this onnxruntime build has; ``cpu`` never does; ``gpu`` fails
    when there is none. What actually runs is ``OrtRunner.provider`` (a provider whose libraries do
    not load is dropped by onnxruntime at session creation).
    """
    available = require("onnxruntime", ORT_PURPOSE).get_available_providers()
    gpu = [p for p in GPU_PROVIDERS if p in available]
    if device == "cpu":
        return ["CPUExecutionProvider"], "CPU requested"
    if device == "gpu" and not gpu:
        raise CorpError(
            "onnxruntime has no GPU provider here; install onnxruntime-gpu instead of onnxruntime "
            "(never both), or use the CPU"
        )
    if device not in ("auto", "gpu"):
        raise CorpError(f"onnxruntime device must be auto, cpu or gpu, got {device!r}")
    if gpu and torch.cuda.is_available():
        return [*gpu, "CPUExecutionProvider"], f"GPU providers available: {', '.join(gpu)}"
    why = "no CUDA GPU visible" if gpu else "this onnxruntime build has no GPU provider (onnxruntime-gpu)"
    return ["CPUExecutionProvider"], why


@functools.cache
def shared_cpu_arena() -> None:
    """Register one CPU arena for the process, which every ``OrtRunner`` session allocates from.

    A session's own arena grows to its largest call and is never given back while the session lives: deit_small's
    FP32 graph held 0.7 GB after one batch-32 call and 1.4 GB after a batch-64 one. The INT8 choice keeps a reference
    session and races five candidates at once, so one export's sessions held several GB (issue 49: a 9.3 GB peak for
    a 22M-parameter model). Calls run one at a time, so one shared arena holds one call's buffers (the largest), as
    fast as a session's own (the same allocator, measured interleaved)."""
    ort = require("onnxruntime", ORT_PURPOSE)
    cpu = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(cpu, ort.OrtArenaCfg({}))


class OrtRunner:
    """An ONNX file in onnxruntime; ``provider`` is the one that actually got the graph. Its CPU buffers come from the
    process's one arena (``shared_cpu_arena``).

    ``lean``: no pre-packing, for a check of a big graph rather than its speed. Pre-packing copies every MatMul weight
    into a packed buffer while the graph's own is still mapped from its ``.data`` file: the 1.7B-wide shape cut to one
    layer (1.0 GiB of weights, 2026-12-02) peaked 1.0 GiB above the process while its session opened, and 0.0 without
    it (the weights stay mapped from the file); its two verification calls held 0.66 GiB either way."""

    def __init__(self, path: str | Path, device: str = "auto", threads: int | None = None, lean: bool = False):
        ort = require("onnxruntime", ORT_PURPOSE)
        providers, self.why = ort_providers(device)
        options = ort.SessionOptions()
        options.log_severity_level = 3  # onnxruntime's warnings are about its own fallbacks
        shared_cpu_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
        if lean:
            options.add_session_config_entry("session.disable_prepacking", "1")
        if threads:
            options.intra_op_num_threads = threads
        try:
            chosen = [(p, PROVIDER_OPTIONS.get(p, {})) for p in providers]
            self.session = ort.InferenceSession(str(path), options, providers=chosen)
        except Exception as e:
            load_onnx(path, weights=False)  # a missing or non-ONNX file's own line (parsed only here: seconds a graph)
            raise CorpError(f"onnxruntime cannot load {path}: {str(e).splitlines()[0]}") from None
        self.provider = self.session.get_providers()[0]
        self.input = self.session.get_inputs()[0].name
        self.output = self.session.get_outputs()[0].name
        self.name = f"ort-{self.provider.removesuffix('ExecutionProvider').lower()}"

    def feeds(self, x: Feed) -> dict[str, np.ndarray]:
        """``x`` by input name: an image array goes to the graph's one input."""
        return x if isinstance(x, dict) else {self.input: x}

    def __call__(self, x: Feed) -> np.ndarray:
        (out,) = self.session.run(None, self.feeds(x))
        return out.astype(np.float32, copy=False)

    def on_gpu(self, x: Feed) -> Callable[[], object]:
        """``x`` copied to the GPU once; a call that runs on it and leaves the output there.

        onnxruntime's I/O binding: what a GPU latency is without the host<->device copies that
        ``__call__`` makes. The call returns once the result is on the device.
        """
        ort = require("onnxruntime", ORT_PURPOSE)
        binding = self.session.io_binding()
        for name, array in self.feeds(x).items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
        binding.bind_output(self.output, "cuda")
        return lambda: self.session.run_with_iobinding(binding)


class Memo:
    """A runner whose outputs are kept by the content of their input: a reference that many candidates are compared
    with on the same held-out data (every INT8 recipe, the fused graph, the baseline) runs once per input."""

    def __init__(self, runner: Runner) -> None:
        self.runner, self.name = runner, getattr(runner, "name", "reference")
        self.outputs: dict[str, np.ndarray] = {}
        self.runs = 0

    def __call__(self, x: Feed) -> np.ndarray:
        arrays = x.items() if isinstance(x, dict) else [("", x)]
        digest = hashlib.sha1()
        for name, a in sorted(arrays, key=lambda item: item[0]):
            digest.update(f"{name}:{a.dtype}:{a.shape}".encode())
            digest.update(np.ascontiguousarray(a).data)
        key = digest.hexdigest()
        if key not in self.outputs:
            self.outputs[key] = self.runner(x)
            self.runs += 1
        return self.outputs[key]
