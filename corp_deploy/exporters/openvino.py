"""OpenVINO IR, one registered target: the verified ONNX graphs converted to OpenVINO's IR (``.xml`` + ``.bin``) in
FP32 and quantized to INT8 by NNCF (OpenVINO's own post-training quantization, with calibration data), each verified
against its reference before it is kept, and timed on the CPU beside onnxruntime in the same ``bench`` run.

- FP32: ``openvino.convert_model(dense.onnx)`` -> ``dense.xml``, checked against onnxruntime on the same graph
  (the FP32 gate). The IR runs with ``INFERENCE_PRECISION_HINT`` f32: OpenVINO's CPU plugin would otherwise run
  BF16 on CPUs that have it, and FP32 would not mean FP32.
- INT8: ``nncf.quantize`` (static, ``ModelType.TRANSFORMER``) on the calibration inputs INT8 ONNX reads, checked
  against the FP32 IR on the held-out ones (the INT8 gate). The dense model quantized this way, ``dense.int8.xml``,
  is the quantize-only baseline on OpenVINO: what a user gets from OpenVINO without pruning.

Adding this target touched no other module: ``exporters.targets`` registers it, and the CLI, the pipeline, the
run folder and the bench loop read it from there.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from corp_deploy.base.deps import register_package, require
from corp_deploy.base.env import module_versions
from corp_deploy.base.fsio import staged
from corp_deploy.exporters.compare import Feed, Tolerance, check, summary
from corp_deploy.exporters.onnx_export import load_onnx
from corp_deploy.exporters.targets import BenchSpec, Job, Option, Target, register
from corp_deploy.formats.precisions import FP32, INT8
from corp_deploy.formats.run_folder import onnx_name, write_sidecar

PURPOSE = "the OpenVINO target"
register_package("openvino", "openvino", "openvino", "2025.0")
register_package("nncf", "nncf", "openvino", "2.16")
MODULES = ("openvino", "nncf")
LOAD = "openvino.Core().compile_model({p}, 'CPU')"
NNCF_WHAT = "nncf.quantize: static INT8, ModelType.TRANSFORMER, OpenVINO's own post-training quantization"
MIXED = "mixed"
PRESET = Option(
    "--openvino-int8-preset",
    "OpenVINO INT8 (NNCF): mixed (symmetric weights, asymmetric activations: NNCF's choice for transformers) or "
    "performance (symmetric both: faster kernels on some CPUs, a larger error).",
    MIXED,
    type=(MIXED, "performance"),
)
"""The target's option group: NNCF's quantization preset."""


def ir_name(stem: str, precision: str) -> str:
    """``dense.xml``, ``pruned.int8.xml`` (each with its ``.bin``): FP32 carries no precision in its name."""
    return f"{stem}.xml" if precision == FP32.name else f"{stem}.{precision}.xml"


@functools.cache
def core():
    """The process's one ``openvino.Core``. Each Core's CPU plugin replaces the calling thread's alternate signal
    stack (``sigaltstack``) with its own when it first compiles, and puts back the one it found when it is freed:
    two Cores freed in the order they were made (not the reverse) leave the thread on the first one's stack, already
    unmapped, and the next signal whose handler runs on that stack (every Python-level handler: CPython installs them
    ``SA_ONSTACK``; torch's DataLoader handles SIGCHLD, so a later calibration with image workers; Ctrl-C) kills the
    process with SIGSEGV (measured with openvino 2026.4.1: docs/USAGE.md, troubleshooting). One Core, never freed,
    sets its stack once and never restores a stale one."""
    return require("openvino", PURPOSE).Core()


class OvRunner:
    """An IR on OpenVINO's CPU plugin, numpy in, FP32 numpy out; FP32 kept FP32 (``INFERENCE_PRECISION_HINT``
    f32), the threads and the performance hint set, so a timing is comparable with onnxruntime's."""

    def __init__(self, path: str | Path, threads: int | None = None, hint: str = "LATENCY"):
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": hint}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        self.compiled = core().compile_model(str(path), "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.input = self.compiled.inputs[0].get_any_name()
        self.name = "openvino-cpu"

    def __call__(self, x: Feed) -> np.ndarray:
        self.request.infer(x if isinstance(x, dict) else {self.input: x})
        return np.array(self.request.get_output_tensor(0).data, dtype=np.float32)


def _files_bytes(xml: Path) -> int:
    return xml.stat().st_size + xml.with_suffix(".bin").stat().st_size


def convert_verified(src: Path, out: Path, inputs, tol: Tolerance, batches) -> dict[str, Any]:
    """``src`` (a verified FP32 ONNX graph) as FP32 IR at ``out``, checked against onnxruntime on ``src``."""
    from corp_deploy.exporters.compare import verify
    from corp_deploy.exporters.runners import OrtRunner

    ov = require("openvino", PURPOSE)
    start = time.perf_counter()
    ov.save_model(ov.convert_model(str(src)), str(out), compress_to_fp16=False)
    seconds = time.perf_counter() - start
    reference, candidate = OrtRunner(src, "cpu"), OvRunner(out)
    comparisons = verify(reference, candidate, inputs, batches)
    check(comparisons, tol, f"OpenVINO IR {out.name} against {src.name}")
    return _record(src, out, FP32.name, seconds, reference, candidate, comparisons, tol) | {"converted_from": src.name}


def quantize_verified(
    src: Path, out: Path, calibration: list[Feed], held_out, tol: Tolerance, preset: str = MIXED
) -> dict[str, Any]:
    """The FP32 IR ``src`` quantized by NNCF on ``calibration`` at ``out`` (``preset``: NNCF's activation scheme),
    checked against ``src`` on ``held_out`` (``int8_quant.compare_on``: one sample and all of them in one batch)."""
    from corp_deploy.exporters.int8_quant import compare_on

    ov, nncf = require("openvino", PURPOSE), require("nncf", PURPOSE)
    start = time.perf_counter()
    model = core().read_model(str(src))
    name = model.inputs[0].get_any_name()
    dataset = nncf.Dataset(calibration, lambda feed: feed if isinstance(feed, dict) else {name: feed})
    scheme = nncf.QuantizationPreset(preset)
    quantized = nncf.quantize(
        model, dataset, preset=scheme, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(calibration)
    )
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    gc.collect()  # NNCF's engines (a Core each, see ``core``) freed now, newest first, while ours holds its stack
    seconds = time.perf_counter() - start
    reference, candidate = OvRunner(src), OvRunner(out)
    comparisons = compare_on(reference, candidate, held_out)
    check(comparisons, tol, f"INT8 OpenVINO IR {out.name} against {src.name} on held-out inputs")
    record = _record(src, out, INT8.name, seconds, reference, candidate, comparisons, tol)
    what = {"int8": NNCF_WHAT, "preset": preset, "calibration_batches": len(calibration)}
    return record | what | {"quantized_from": src.name}


def _record(src: Path, out: Path, precision: str, seconds: float, reference, candidate, comparisons, tol) -> dict:
    """The sidecar every IR file gets: the file, its target and precision, its size and time, its verification."""
    verify_ = {"reference": f"{src.name} ({reference.name})", "runtime": candidate.name, **summary(comparisons)}
    return {
        "file": out.name,
        "target": "openvino",
        "precision": precision,
        "bytes": _files_bytes(out),
        "seconds": round(seconds, 2),
        "verify": verify_ | {"tolerance": tol.__dict__},
        "versions": module_versions(MODULES),
    }


def write(job: Job) -> list[dict[str, Any]]:
    """Every model's FP32 IR from its verified ONNX graph, then (``int8`` asked) its NNCF INT8 IR; each staged,
    with its ``.json`` record, and kept only when it passes its gate."""
    from corp_deploy.exporters.pipeline import graph_inputs

    records = []
    for stem in job.stems:
        src, xml = job.out / onnx_name(stem), job.out / ir_name(stem, FP32.name)
        inputs = graph_inputs(load_onnx(src, weights=False), job.opts.seed)
        with staged(xml, overwrite=True) as stage:
            record = convert_verified(src, stage / xml.name, inputs, job.opts.fp32, job.opts.batches)
            write_sidecar(stage / xml.name, record)
        records.append(record)
    if INT8.name not in job.precisions:
        return records
    for stem in job.stems:
        src, xml = job.out / ir_name(stem, FP32.name), job.out / ir_name(stem, INT8.name)
        calibration, held_out, _ = job.data(load_onnx(job.out / onnx_name(stem), weights=False))
        with staged(xml, overwrite=True) as stage:
            preset = job.options.get(PRESET.name, MIXED)
            record = quantize_verified(src, stage / xml.name, list(calibration), held_out, job.opts.int8, preset)
            write_sidecar(stage / xml.name, record)
        records.append(record)
    return records


def _runner(path: Path, threads: int | None) -> Callable[[Feed], np.ndarray]:
    return OvRunner(path, threads)


register(
    Target(
        name="openvino",
        what="OpenVINO IR (.xml + .bin) on OpenVINO's CPU plugin; INT8 by NNCF",
        precisions=(FP32.name, INT8.name),
        file_name=ir_name,
        write=write,
        runner=_runner,
        modules=MODULES,
        files=(
            (
                "*.int8.xml",
                "OpenVINO IR, INT8 by NNCF (its .json: the gate)",
                "openvino.Core().compile_model({p}, 'CPU')",
            ),
            (
                "*.xml",
                "OpenVINO IR, FP32 (its .json: how it was verified)",
                "openvino.Core().compile_model({p}, 'CPU')",
            ),
            ("*.bin", "the weights of the OpenVINO IR of the same name", ""),
        ),
        backends=tuple(BenchSpec(f"ov-cpu-{p}", "openvino", "cpu", p) for p in (FP32.name, INT8.name)),
        options=(PRESET,),
        baseline=lambda root: (root / ir_name("dense", INT8.name), f"dense.int8.xml of the run folder ({NNCF_WHAT})"),
    )
)
