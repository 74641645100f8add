"""PyTorch -> ONNX with a dynamic batch axis, checked by ``onnx.checker``, written atomically.

The dynamo exporter (``torch.export`` underneath) is used: it handles the pruned attention (Q/K
width != V width, explicit softmax scale) and writes sizes derived from the input's shape, so the
batch stays symbolic. Preprocessing and provenance go into the graph's ``metadata_props`` so the
file describes itself.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import sha256

DEFAULT_OPSET = 20
"""Verified here: the pruned SDPA decomposes to MatMul/Softmax and matches onnxruntime (tests/exporters/test_export.py,
docs/BENCHMARKS.md "Export")."""

OPSETS = range(18, 24)
INPUT = "images"
OUTPUT = "output"
EXAMPLE_BATCH = 2
"""Trace with batch 2: torch.export specialises sizes 0 and 1, which would pin the batch axis."""

MAX_SINGLE_FILE = 2 * 2**30
"""protobuf's limit; larger models keep their weights in a ``.onnx.data`` file beside the graph."""


def _onnx():
    return require("onnx", "ONNX export")


def export_onnx(
    model: nn.Module,
    path: str | Path,
    input_size: tuple[int, int, int],
    opset: int = DEFAULT_OPSET,
    simplify: bool = False,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Export ``model`` (moved to CPU, eval) to ``path`` with a symbolic batch axis, and check it.

    Writes ``path`` (and ``path.data`` for models over 2 GB) in place: callers stage it
    (``corp_deploy.base.fsio.staged``) so that a failed export or verification leaves nothing.
    """
    onnx = _onnx()
    check_opset(opset)
    model = image_graph(model.to("cpu").eval())
    external = external_weights(model)
    proto = _trace(model, torch.randn(EXAMPLE_BATCH, *input_size), opset, _forward_params(model)[0])
    if simplify:
        proto = _simplify(proto)
    add_metadata(proto, metadata or {})
    path = Path(path)
    onnx.save(proto, str(path), save_as_external_data=external, location=f"{path.name}.data")
    check_onnx(path)
    return path


def external_weights(model: nn.Module) -> bool:
    """Whether ``model``'s graph keeps its weights in ``<graph>.data`` beside it: at ``MAX_SINGLE_FILE`` and above,
    which one protobuf message cannot hold."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) >= MAX_SINGLE_FILE


class ImageGraph(nn.Module):
    """A ``transformers`` image model as a graph of one output, as timm's: its ``logits`` (a classification head)
    or its ``last_hidden_state`` (a backbone: every token's features after the final norm, [CLS] first, as a text
    encoder's graph gives them; pooling stays with the caller)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixel_values)
        return out.logits if "logits" in out else out.last_hidden_state


def image_graph(model: nn.Module) -> nn.Module:
    """What an image model's graph computes: the model itself (timm), or ``ImageGraph`` of a ``transformers`` one."""
    return ImageGraph(model) if type(model).__module__.startswith("transformers") else model


def check_opset(opset: int) -> None:
    """Refuse an opset outside the verified range, before anything is traced."""
    if opset not in OPSETS:
        raise CorpError(f"--opset {opset} is not supported; choose {OPSETS.start}..{OPSETS.stop - 1} (default 20)")


def _trace(model: nn.Module, example: torch.Tensor, opset: int, forward_arg: str):
    try:
        with _quiet():
            program = torch.onnx.export(
                model,
                (example,),
                input_names=[INPUT],
                output_names=[OUTPUT],
                opset_version=opset,
                dynamic_shapes={forward_arg: {0: torch.export.Dim("batch")}},
                dynamo=True,
                verbose=False,
            )
    except Exception as e:
        raise CorpError(f"ONNX export failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return program.model_proto


def _forward_params(model: nn.Module) -> list[str]:
    return list(inspect.signature(model.forward).parameters)


@contextlib.contextmanager
def _quiet():
    """The exporter prints progress lines and warnings meant for its developers; keep the terminal ours."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _simplify(proto):
    onnxslim = require("onnxslim", "--simplify")
    with _quiet():
        return onnxslim.slim(proto)


def add_metadata(proto, metadata: dict[str, Any]) -> None:
    """Store ``metadata`` as JSON strings in ``metadata_props`` (visible in Netron, readable by ORT).

    Existing keys are replaced, so a converted graph can restate what it inherited.
    """
    kept = [e for e in proto.metadata_props if e.key not in metadata]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key = key
        entry.value = value if isinstance(value, str) else json.dumps(value)


def append_metadata(path: str | Path, metadata: dict[str, Any]) -> None:
    """Add ``metadata`` to the graph file at ``path`` without reading it: a model message holding only these
    ``metadata_props`` is appended to the file, and protobuf reads concatenated messages as one, their repeated fields
    joined. Parsing, editing and re-serializing a decoder's graph with its weights inside costs seconds a graph
    (SmolLM2-135M's 520 MB: docs/BENCHMARKS.md "Scale: time to artifact"); this costs the bytes of the metadata.
    For a file whose writer set none of these keys (the TorchScript exporter sets none): where ``add_metadata``
    replaces a key, this would add a second entry."""
    extra = _onnx().ModelProto()
    add_metadata(extra, metadata)
    with open(path, "ab") as f:
        f.write(extra.SerializeToString())


def read_metadata(proto) -> dict[str, Any]:
    """``metadata_props`` of an ONNX model, JSON values decoded."""
    out = {}
    for entry in proto.metadata_props:
        try:
            out[entry.key] = json.loads(entry.value)
        except json.JSONDecodeError:
            out[entry.key] = entry.value
    return out


def load_onnx(path: str | Path, weights: bool = True):
    """Parse an ONNX file, with a one-line error for a missing or non-ONNX file."""
    onnx = _onnx()
    path = Path(path)
    if not path.is_file():
        raise CorpError(f"ONNX file {path} does not exist; create it with `corp-deploy export`")
    try:
        proto = onnx.load(str(path), load_external_data=weights)
    except Exception as e:
        raise CorpError(f"{path} is not a readable ONNX model ({str(e).splitlines()[0]}); re-export it") from None
    if not proto.graph.node:
        raise CorpError(f"{path} is not an ONNX model (no graph nodes); re-export it")
    return proto


def onnx_files(path: str | Path, proto=None) -> list[Path]:
    """The graph file and the files beside it holding its external weights (``<graph>.data``): what moves,
    links or counts as one ONNX model. ``proto`` is the graph if already loaded (weights not needed)."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    path = Path(path)
    proto = proto if proto is not None else load_onnx(path, weights=False)
    locations = {ExternalDataInfo(t).location for t in _tensors(proto) if uses_external_data(t)}
    return [path, *(path.parent / location for location in sorted(locations))]


def onnx_sha256(path: str | Path) -> str:
    """sha256 of an ONNX model as a whole, graph then external weights: what an output made from it records,
    so that re-exported weights behind an unchanged graph file still make that output stale."""
    return sha256(*onnx_files(path))


def onnx_bytes(path: str | Path, proto=None) -> int:
    """Size of an ONNX model on disk: its graph and its external weights (``proto``: as in ``onnx_files``)."""
    return sum(f.stat().st_size for f in onnx_files(path, proto))


def _tensors(proto) -> Iterator:
    """Every tensor stored in the graph: initializers, and node attributes (where some writers put weights)."""
    yield from proto.graph.initializer
    for node in proto.graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors


def check_onnx(path: str | Path) -> None:
    """``onnx.checker`` with shape inference, by path so that external data works. A graph with operators that
    onnxruntime adds to the ONNX domain (genai's builder writes ``SimplifiedLayerNormalization``) is not checked:
    onnx has no schema for them and refuses the graph; onnxruntime's run of it verifies it instead."""
    onnx = _onnx()
    nodes = load_onnx(path, weights=False).graph.node
    if not all(onnx.defs.has(n.op_type, n.domain) for n in nodes if n.domain in ("", "ai.onnx")):
        return
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise CorpError(f"{path} fails onnx.checker: {str(e).splitlines()[0]}") from None


def input_shape(proto) -> tuple[int, ...]:
    """The (C, H, W) of the graph's single image input; the batch axis may be symbolic."""
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    shape = tuple(d.dim_value for d in dims[1:])
    if len(dims) != 4 or not all(shape):
        raise CorpError("the ONNX input must be one NCHW image batch with fixed C, H, W; re-export it")
    return shape


def graph_precision(proto) -> str:
    """``int8`` for a Q/DQ graph; ``fp16`` when its float weights are mostly half precision; else ``fp32``."""
    from onnx import TensorProto

    if any(n.op_type == "QuantizeLinear" for n in proto.graph.node):
        return "int8"

    counts = {TensorProto.FLOAT: 0, TensorProto.FLOAT16: 0}
    for init in proto.graph.initializer:
        if init.data_type in counts:
            counts[init.data_type] += 1
    return "fp16" if counts[TensorProto.FLOAT16] > counts[TensorProto.FLOAT] else "fp32"
