"""ONNX, the target every run writes first: the PyTorch models exported and checked against PyTorch
(``dense.onnx``, ``pruned.onnx``), their FP16 copies checked against them, and their INT8 graphs (the fastest recipe
that passes the INT8 gate). The other targets convert from these verified FP32 graphs.

Its bench backends are onnxruntime's: ``ort-cpu-fp32``, ``ort-cpu-int8`` and ``ort-cuda-fp32``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corp_deploy.base.deps import optional
from corp_deploy.base.fsio import staged
from corp_deploy.base.steps import each
from corp_deploy.exporters.runners import OrtRunner
from corp_deploy.exporters.targets import ONNX, BenchSpec, Job, Target, register
from corp_deploy.formats.precisions import FP16, FP32, INT8
from corp_deploy.formats.run_folder import onnx_name

LOAD = "onnxruntime.InferenceSession({p})"


def write(job: Job) -> list[dict[str, Any]]:
    """Every model's verified FP32 graph (and FP16 copy when asked), then, with ``quantize`` in the options (the
    INT8 step bound to its calibration data: ``int8_recipes.quantize_graphs``), their INT8 graphs. Each file is
    staged on its own, so a run that stops keeps each file that finished, whole. Each model is let go
    (``Job.free``) once its graph is written and PyTorch's outputs are kept, before onnxruntime checks the graph."""
    from corp_deploy.exporters.pipeline import convert_verified, export_verified

    o, records = job.options, []
    with job.step(f"ONNX export and verification ({', '.join(job.stems)})"):
        for stem in each("ONNX export", [(s, s) for s in job.models], job.say):
            model, description = job.models[stem]  # read now: ``pipeline.OneAtATime`` holds one at a time
            fp32 = job.out / onnx_name(stem)
            with staged(fp32) as stage:
                written = export_verified(
                    model, stage / fp32.name, description, o["opset"], o["simplify"], job.opts, o["rewrites"], job.free
                )
            records.append(written)
            if FP16.name in job.precisions:
                half = job.out / onnx_name(stem, FP16.name)
                with staged(half) as stage:
                    records.append(convert_verified(fp32, stage / half.name, job.opts))
    if o.get("quantize") is not None:
        with job.step("INT8 quantization"):
            records += o["quantize"]([(job.out / onnx_name(s), job.out / onnx_name(s, INT8.name)) for s in job.stems])
    return records


def _cuda_provider_missing(_: Path) -> str | None:
    """Why onnxruntime cannot run a graph on the GPU here, or None."""
    import torch

    ort = optional("onnxruntime")
    if ort is not None and "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDA provider (install onnxruntime-gpu instead of onnxruntime)"
    return None if torch.cuda.is_available() else "no CUDA GPU visible"


def _made_by(root: Path, precision: str) -> str:
    if precision == INT8.name:
        return f"corp-deploy quantize {root} --calib-dir DIR"
    return f"corp-deploy prune-export --precision {precision}"


register(
    Target(
        name=ONNX,
        what="ONNX graphs checked against PyTorch in onnxruntime; FP16 and INT8 gated against FP32",
        precisions=(FP32.name, FP16.name, INT8.name),
        file_name=onnx_name,
        write=write,
        runner=lambda path, threads: OrtRunner(path, "cpu", threads),
        modules=("onnx", "onnxruntime"),
        backends=(
            BenchSpec("ort-cpu-fp32", "onnxruntime", "cpu", FP32.name),
            BenchSpec("ort-cpu-int8", "onnxruntime", "cpu", INT8.name),
            BenchSpec("ort-cuda-fp32", "onnxruntime", "cuda", FP32.name, ready=_cuda_provider_missing),
        ),
        files=(
            ("*.int8.onnx", "INT8 ONNX graph (its .json: the recipe and the gate)", LOAD),
            ("*.fp16.onnx", "FP16 ONNX graph, FP32 inputs and outputs", LOAD),
            ("*.onnx", "FP32 ONNX graph (its .json: how it was verified)", LOAD),
        ),
        record="onnx",
        step=None,
        made_by=_made_by,
    )
)
