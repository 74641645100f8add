"""FP32 ONNX -> FP16-typed ONNX with FP32 inputs/outputs, for strongly typed TensorRT.

TensorRT 11 builds exactly the types in the graph (no FP16 builder flag), so precision is decided
here. onnxconverter-common's converter does the rewrite; the ops in ``KEEP_FP32`` stay in FP32
(beside the converter's own block list; the graph's ``fp16_kept_fp32_ops`` records both) because
their accumulations (mean/variance, exp-sum) lose accuracy in half precision, and casts around them
are cheap next to the matmuls that FP16 speeds up.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.exporters.onnx_export import add_metadata, check_onnx, load_onnx

KEEP_FP32 = (
    "LayerNormalization",
    "Softmax",
    "ReduceMean",
    "ReduceSum",
    "ReduceSumSquare",
    "ReduceL2",
    "Pow",
    "Sqrt",
)


def convert_fp16(src: str | Path, out: str | Path) -> Path:
    """Write an FP16 copy of the FP32 graph ``src`` to ``out`` (single file), checked; callers stage ``out``."""
    float16 = require("onnxconverter_common.float16", "FP16 ONNX")
    proto = load_onnx(src)
    blocked = sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(KEEP_FP32))
    try:
        with warnings.catch_warnings():  # one warning per weight below FP16's range: noise, not news
            warnings.simplefilter("ignore")
            half = float16.convert_float_to_float16(proto, keep_io_types=True, op_block_list=blocked)
    except Exception as e:
        raise CorpError(f"FP16 conversion of {src} failed: {str(e).splitlines()[0]}") from None
    add_metadata(half, {"precision": "fp16", "fp16_kept_fp32_ops": blocked})
    import onnx

    onnx.save(half, str(out))
    check_onnx(out)
    return Path(out)
