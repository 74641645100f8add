"""Exporters: ONNX (FP32 and FP16, verified with onnxruntime) and TensorRT / TensorRT-RTX engines.

corp_deploy.exporters.onnx_export      PyTorch -> ONNX with a dynamic batch axis
corp_deploy.exporters.fp16             FP32 ONNX -> FP16-typed ONNX for strongly typed TensorRT
corp_deploy.exporters.tensorrt_engine  engine build (either flavour), sidecar metadata and checks, the engine runner
corp_deploy.exporters.runners          PyTorch and onnxruntime runners
corp_deploy.exporters.compare          comparators and tolerances
corp_deploy.exporters.pipeline         the verified steps and the ``prune-export`` run
"""

from corp_deploy.exporters.compare import FP16, FP32, Comparison, Tolerance, compare, verify
from corp_deploy.exporters.fp16 import convert_fp16
from corp_deploy.exporters.onnx_export import DEFAULT_OPSET, export_onnx, load_onnx, read_metadata
from corp_deploy.exporters.pipeline import VerifyOptions, convert_verified, engine_verified, export_run, export_verified
from corp_deploy.exporters.runners import OrtRunner, TorchRunner
from corp_deploy.exporters.tensorrt_engine import (
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
