"""Exporters: ONNX (FP32 and FP16, verified with onnxruntime) and TensorRT / TensorRT-RTX engines.

exporters.onnx_export      PyTorch -> ONNX with a dynamic batch axis
exporters.fp16             FP32 ONNX -> FP16-typed ONNX for strongly typed TensorRT
exporters.tensorrt_engine  engine build (either flavour), sidecar metadata and checks, the engine runner
exporters.runners          PyTorch and onnxruntime runners
exporters.compare          comparators and tolerances
exporters.pipeline         the verified steps and the ``prune-export`` run
"""

from exporters.compare import FP16, FP32, Comparison, Tolerance, compare, verify
from exporters.fp16 import convert_fp16
from exporters.onnx_export import DEFAULT_OPSET, export_onnx, load_onnx, read_metadata
from exporters.pipeline import VerifyOptions, convert_verified, engine_verified, export_run, export_verified
from exporters.runners import OrtRunner, TorchRunner
from exporters.tensorrt_engine import (
    BuildOptions,
    Profile,
    TrtRunner,
    build_engine,
    build_missing,
    parse_profile,
    run_missing,
)

__all__ = [
    "DEFAULT_OPSET",
    "FP16",
    "FP32",
    "BuildOptions",
    "Comparison",
    "OrtRunner",
    "Profile",
    "Tolerance",
    "TorchRunner",
    "TrtRunner",
    "VerifyOptions",
    "build_engine",
    "build_missing",
    "compare",
    "convert_fp16",
    "convert_verified",
    "engine_verified",
    "export_onnx",
    "export_run",
    "export_verified",
    "load_onnx",
    "parse_profile",
    "read_metadata",
    "run_missing",
    "verify",
]
