"""FP32 ONNX -> FP16-typed ONNX with FP32 inputs/outputs, for strongly typed TensorRT.

TensorRT 11 builds exactly the types in the graph (no FP16 builder flag), so precision is decided
here. onnxconverter-common's converter does the rewrite; the ops in ``KEEP_FP32`` stay in FP32
(beside the converter's own block list; the graph's ``fp16_kept_fp32_ops`` records both) because
their accumulations (mean/variance, exp-sum) lose accuracy in half precision, and casts around them
are cheap next to the matmuls that FP16 speeds up. A decoder's rotary embedding stays FP32 too
(``ROTARY_SCOPE``): its angles are position x frequency, and FP16 holds whole numbers exactly only up to
2048, so longer prompts would rotate by wrong angles (the converter also mistypes its int -> float Cast, which
``onnx.checker`` refuses: Qwen2).
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
ROTARY_SCOPE = "rotary_emb"
"""The module name (``transformers``' ``*RotaryEmbedding``) whose nodes stay FP32, found through the exporter's
``namespace`` metadata (dynamo) or the node's scoped name (TorchScript: ``/model/model/rotary_emb/Cast``)."""


def rotary_nodes(proto) -> list[str]:
    """Names of the nodes the exporter attributes to a rotary embedding module."""
    return [
        n.name
        for n in proto.graph.node
        if f"/{ROTARY_SCOPE}/" in n.name
        or any(p.key == "namespace" and ROTARY_SCOPE in p.value for p in n.metadata_props)
    ]


def casts_to_fp32(proto) -> list[str]:
    """Names of the ``Cast(to=FLOAT)`` nodes: a model's explicit upcast (an RMSNorm's ``x.to(float32)``, kept as a node
    by the TorchScript tracer). The converter retypes their outputs to FP16 but leaves ``to=FLOAT``, which
    ``onnx.checker`` then refuses; kept FP32, they do what the model asked."""
    return [
        n.name
        for n in proto.graph.node
        if n.op_type == "Cast" and any(a.name == "to" and a.i == 1 for a in n.attribute)
    ]


def convert_fp16(src: str | Path, out: str | Path) -> Path:
    """Write an FP16 copy of the FP32 graph ``src`` to ``out`` (single file), checked; callers stage ``out``."""
    float16 = require("onnxconverter_common.float16", "FP16 ONNX")
    proto = load_onnx(src)
    blocked = sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(KEEP_FP32))
    rotary, upcasts = rotary_nodes(proto), casts_to_fp32(proto)
    try:
        with warnings.catch_warnings():  # one warning per weight below FP16's range: noise, not news
            warnings.simplefilter("ignore")
            half = float16.convert_float_to_float16(
                proto, keep_io_types=True, op_block_list=blocked, node_block_list=sorted({*rotary, *upcasts})
            )
    except Exception as e:
        raise CorpError(f"FP16 conversion of {src} failed: {str(e).splitlines()[0]}") from None
    nodes = ", ".join(f"{len(n)} {what}" for n, what in ((rotary, "rotary"), (upcasts, "Cast to FP32")) if n)
    kept = {"fp16_kept_fp32_ops": blocked} | ({"fp16_kept_fp32_nodes": nodes} if nodes else {})
    add_metadata(half, {"precision": "fp16", **kept})
    import onnx

    onnx.save(half, str(out))
    check_onnx(out)
    return Path(out)
