"""SmoothQuant's scale migration as an exact graph transform: a GEMM input's outlier channels move into its weight.

A per-tensor INT8 activation scale is set by the input's largest channel. In BERT-family encoders a few channels
are 3-15x the median channel (all-MiniLM-L6-v2: channel 99 of every LayerNorm output, docs/BENCHMARKS.md), so the
other channels round to a few levels. Dividing input channel j by s_j and multiplying the weight's row j by s_j
leaves the product unchanged, x W = (x / s)(diag(s) W), and flattens the input; the weights, quantized per output
channel, take the wider rows better. s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) (Xiao et al., SmoothQuant, 2023),
with max|x_j| over the calibration batches. onnxruntime's own ``SmoothQuant`` option needs neural-compressor.

The division is an explicit float ``Mul`` in front of the GEMMs that read the input, not folded into the op before
it: in a post-LayerNorm encoder that LayerNorm's output is also the residual stream (scaling its gamma would scale
the residual), and the FFN down-projection's input comes out of GELU, which does not commute with a scale. GEMMs
that share an input (Q, K and V) share one ``Mul`` and one s, from the largest of their weight rows.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from corp_deploy.base.deps import require
from corp_deploy.exporters.compare import Feed
from corp_deploy.exporters.onnx_export import load_onnx, onnx_files

SMOOTH_ALPHA = 0.8
"""How much of an input's range moves into the weights. On all-MiniLM-L6-v2 (fake-quant, 64 held-out BBC
documents) the worst real token's cosine read 0.64 at 0.5 (the FFN down-projection's weights then break), 0.946
at 0.65 and 0.982 at 0.8 (docs/BENCHMARKS.md)."""


def weight_inputs(proto) -> dict[str, list[tuple[int, str, int]]]:
    """Activation -> (node index, weight initializer, axis of the weight's input channels) of every MatMul or
    Gemm that multiplies it by a 2-D initializer used nowhere else."""
    weights = {t.name: t for t in proto.graph.initializer if len(t.dims) == 2}
    uses: dict[str, int] = {}
    for n in proto.graph.node:
        for name in n.input:
            uses[name] = uses.get(name, 0) + 1
    readers: dict[str, list[tuple[int, str, int]]] = {}
    for i, n in enumerate(proto.graph.node):
        if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2 or n.input[1] not in weights:
            continue
        if uses[n.input[1]] > 1 or n.input[0] in weights:
            continue
        attrs = {a.name: a.i for a in n.attribute}
        if attrs.get("transA"):
            continue
        readers.setdefault(n.input[0], []).append((i, n.input[1], 1 if attrs.get("transB") else 0))
    return readers


def channel_absmax(proto, src: Path, names: Sequence[str], batches: Sequence[Feed], tmp: Path) -> dict[str, np.ndarray]:
    """max |x| per last-axis channel of each tensor in ``names`` over ``batches``, from the float graph."""
    onnx = require("onnx", "INT8 smoothing")
    ort = require("onnxruntime", "INT8 smoothing")
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    path = tmp / "absmax.onnx"
    onnx.save(probe, str(path), save_as_external_data=len(onnx_files(src)) > 1)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0].name
    absmax: dict[str, np.ndarray] = {}
    for x in batches:
        outs = session.run(list(names), x if isinstance(x, dict) else {first: x})
        for name, out in zip(names, outs, strict=True):
            m = np.abs(out.reshape(-1, out.shape[-1])).max(axis=0)
            absmax[name] = np.maximum(absmax[name], m) if name in absmax else m
    return absmax


def smooth(src: Path, dst: Path, batches: Sequence[Feed], alpha: float = SMOOTH_ALPHA) -> int:
    """Write ``src`` with every weight GEMM's input smoothed (module docstring) to ``dst``; return the inputs.

    ``dst`` computes what ``src`` does (up to float rounding); its weights stay in one file unless ``src`` kept
    them in external data."""
    onnx = require("onnx", "INT8 smoothing")
    from onnx import numpy_helper

    proto = load_onnx(src)
    readers = weight_inputs(proto)
    with tempfile.TemporaryDirectory(prefix="corp-int8-smooth-") as tmp:
        absmax = channel_absmax(proto, src, list(readers), batches, Path(tmp))
    initializers = {t.name: t for t in proto.graph.initializer}
    before: dict[int, list] = {}
    for x, uses in readers.items():
        ws = [numpy_helper.to_array(initializers[w]) for _, w, _ in uses]
        w_max = np.max([np.abs(w).max(axis=1 - axis) for w, (_, _, axis) in zip(ws, uses, strict=True)], axis=0)
        s = absmax[x].astype(np.float64) ** alpha / np.maximum(w_max, 1e-30).astype(np.float64) ** (1 - alpha)
        s = np.where((absmax[x] > 0) & (w_max > 0) & np.isfinite(s), s, 1.0)
        for w, (_, name, axis) in zip(ws, uses, strict=True):
            scaled = w * (s[:, None] if axis == 0 else s[None, :])
            initializers[name].CopyFrom(numpy_helper.from_array(scaled.astype(w.dtype), name))
        smoothed = f"{x}_smoothed"
        proto.graph.initializer.append(numpy_helper.from_array((1 / s).astype(np.float32), f"{x}_smooth_inverse"))
        mul = onnx.helper.make_node("Mul", [x, f"{x}_smooth_inverse"], [smoothed], name=f"smooth_{x}")
        before.setdefault(min(i for i, _, _ in uses), []).append(mul)
        for i, _, _ in uses:
            proto.graph.node[i].input[0] = smoothed
    nodes = [m for i, n in enumerate(proto.graph.node) for m in (*before.get(i, []), n)]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    onnx.save(proto, str(dst), save_as_external_data=len(onnx_files(src)) > 1, location=f"{dst.name}.data")
    return len(readers)
