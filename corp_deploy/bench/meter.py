"""A latency table's and the closed loop's timing on a bench backend: the ``plan.speed.Meter`` the API's callers
hand to the plan.

The plan decides widths from measured times but never loads the export stack (a plain sparsity prune would pay
for it): it defines what it needs (``plan.speed.Meter``) and the command line, the apps and the studies pass this
one in. Models are exported to a temporary folder (ONNX for onnxruntime, past FP32 through ``CONVERTERS``), loaded
by the backend as ``bench`` loads a run folder, and timed by the plan with ``base.timing``'s interleaved method.
Random weights are fine: values do not change a dense GEMM's time.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from corp_deploy.base.deps import missing
from corp_deploy.base.env import cpu_model
from corp_deploy.base.errors import CorpError
from corp_deploy.base.timing import Step, Workload
from corp_deploy.bench.backends import Backend, all_backends
from corp_deploy.exporters.onnx_export import DEFAULT_OPSET, export_onnx, image_graph
from corp_deploy.exporters.rewrites import rewritten
from corp_deploy.exporters.text_onnx import export_text_onnx, graph
from corp_deploy.formats.data import input_size
from corp_deploy.formats.run_folder import Text

Convert = Callable[[Path, Path], None]
CONVERTERS: dict[str, Convert] = {}
"""Backend precision other than FP32 -> how an exported FP32 graph (source) becomes the graph an ``ort-`` backend of
that precision runs (destination, ``_Models.onnx``). INT8 plugs in here (a static quantizer calibrated on random
inputs: values do not change an INT8 GEMM's time either); ``check_backend`` refuses a precision without one."""


@dataclass
class _Models:
    """Named models as bench's backend loaders read a run folder: ONNX files beside them, torch modules, and the
    inputs (``bench.backends.inputs_for``): images of ``input_size``, or ``text``'s token ids."""

    root: Path
    models: dict[str, nn.Module]
    input_size: tuple[int, ...] | None
    text: Text | None = None
    rewrites: tuple[str, ...] = ()
    """What bench's torch loaders apply: nothing, ``BackendMeter.loaded`` applied the rewrites already."""

    def onnx(self, which: str, precision: str = "fp32") -> Path:
        return self.root / (f"{which}.onnx" if precision == "fp32" else f"{which}.{precision}.onnx")

    def torch_model(self, which: str) -> nn.Module:
        """A copy (a loader moves and casts what it gets, and the caller's model must stay as it was, e.g. fp32
        for the closed loop's next round); a text encoder as exported (``text_onnx.graph``)."""
        model = copy.deepcopy(self.models[which])
        return image_graph(model) if self.text is None else graph(model)[0]

    def export(self, which: str, precision: str) -> None:
        """``which``'s ONNX graph (text: dynamic batch and sequence) and, past FP32, ``CONVERTERS``' graph."""
        model, fp32 = self.models[which], self.onnx(which)
        if self.text is None:
            export_onnx(model, fp32, self.input_size)
        else:
            export_text_onnx(model, fp32)
        if precision != "fp32":
            CONVERTERS[precision](fp32, self.onnx(which, precision))


@dataclass(frozen=True)
class BackendMeter:
    """``plan.speed.Meter`` on one bench ``backend``: what a table's key records of it, and its timed steps."""

    backend: Backend

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def equal_heads(self) -> bool:
        return self.backend.equal_heads

    def key_fields(self) -> dict[str, Any]:
        """What a block's time depends on here: the device, the precision, the runtime's libraries, the graph's
        opset and the exact rewrites applied (none: the keys cached before rewrites existed)."""
        b = self.backend
        ort = b.runtime == "onnxruntime"
        applied = {"applied": list(b.rewrites)} if b.rewrites else {}
        return {
            "device": torch.cuda.get_device_name() if b.device == "cuda" else cpu_model(),
            "precision": b.precision,
            "libraries": ["onnx", "onnxruntime"] if ort else [],
            "rewrites": ({"opset": DEFAULT_OPSET} if ort else {}) | applied,
        }

    @contextmanager
    def loaded(self, models: dict[str, nn.Module], workload: Workload) -> Iterator[dict[str, Step]]:
        """A timed step per model on ``workload`` on the backend (ONNX files exported to a temporary folder for ort).

        Every model runs with the workload's rewrites (default: the backend's, ``Backend.rewrites``) applied where
        exact, as the deployed model would: a latency table and the closed loop time what is deployed.
        """
        batch, threads, rewrites, seq_len = workload.batch, workload.threads, workload.rewrites, workload.seq_len
        if threads:
            torch.set_num_threads(threads)
        first = next(iter(models.values()))
        text = None if seq_len is None else Text(first.config.vocab_size, seq_len)
        shape = tuple(input_size(first)) if text is None else None
        names = self.backend.rewrites if rewrites is None else rewrites
        models = {name: rewritten(model, names)[0] for name, model in models.items()}
        with tempfile.TemporaryDirectory(prefix="corp-latency-") as tmp:
            run = _Models(Path(tmp), models, shape, text)
            if self.backend.runtime == "onnxruntime":
                for name in models:
                    run.export(name, self.backend.precision)
            yield {name: self.backend.load(run, name, False, threads)(batch) for name in models}


def check_backend(name: str, rewrites: tuple[str, ...] | None = None) -> BackendMeter:
    """The bench backend a latency budget is measured on, timing models with ``rewrites`` (None: the backend's
    defaults; ``prune-export --rewrites`` passes what it exports); one line when it cannot be here."""
    backends = all_backends()
    if name not in backends:
        raise CorpError(f"--latency-on: unknown backend {name!r}; choose from {', '.join(backends)}")
    backend = backends[name]
    if backend.device == "cuda" and not torch.cuda.is_available():
        raise CorpError(f"--latency-on {name} cannot run here: no CUDA GPU visible; use ort-cpu-fp32 or torch-cpu-fp32")
    converted = backend.runtime == "onnxruntime" and backend.precision != "fp32"  # a graph made from the FP32 one
    if backend.runtime == "tensorrt" or (converted and backend.precision not in CONVERTERS):
        raise CorpError(
            f"--latency-on {name} is not supported yet: every model of the latency grid would need its own "
            "engine or INT8 calibration; use ort-cpu-fp32, torch-cpu-fp32 or a torch-cuda backend"
        )
    if backend.runtime == "onnxruntime" and (absent := missing("onnx", "onnxscript", "onnxruntime")):
        raise CorpError(f"--latency-on {name} needs {absent}")
    if backend.compiler and (reason := backend.missing(None)):
        raise CorpError(f"--latency-on {name} cannot run here: {reason}")
    return BackendMeter(backend if rewrites is None else dataclasses.replace(backend, chosen_rewrites=tuple(rewrites)))
