"""Exporters: loaders, converters, runners and comparators, each a module of its own (Polygraphy's split).

corp_deploy.exporters.onnx_export      PyTorch -> ONNX with a dynamic batch axis, checked and written atomically
corp_deploy.exporters.text_onnx        text models -> ONNX with dynamic batch and sequence
corp_deploy.exporters.kv_cache         decoders -> one decode-step graph with the key/value cache
corp_deploy.exporters.fused_decoder    the decode step as onnxruntime-genai's builder writes it (fused operators)
corp_deploy.exporters.genai            onnxruntime-genai folders, verified by generating with them
corp_deploy.exporters.rewrites         exact fixed-cost rewrites (the same function, faster kernels)
corp_deploy.exporters.fp16             FP32 ONNX -> FP16-typed ONNX for strongly typed TensorRT
corp_deploy.exporters.smooth           SmoothQuant's scale migration as an exact graph transform
corp_deploy.exporters.int8_quant       FP32 ONNX -> static INT8 (Q/DQ), gated on held-out inputs
corp_deploy.exporters.int8_recipes     INT8 recipes (static, dynamic, smoothed; fused or not), the fastest passing one
corp_deploy.exporters.int4_quant       INT4 weight-only schemes and the quantizer (MatMulNBits)
corp_deploy.exporters.int4_gate        the INT4 gate: perplexity and greedy agreement against FP32
corp_deploy.exporters.int4             INT4 recipes (the project's and genai's builder's), the fastest passing one
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
