"""Text models (``transformers``, dense or pruned) -> ONNX with dynamic batch AND sequence, verified.

The graph takes ``input_ids`` and ``attention_mask`` (int64, batch x sequence) and returns an encoder's
``last_hidden_state`` (pooling stays with the caller, as with sentence-transformers) or a causal LM's
``logits`` (the full-sequence forward, no key/value cache: scoring and prefill, not token-by-token decoding).
Two exporters (``EXPORTERS``, the one used recorded in the graph as ``exporter``): a causal LM's logits graph is
traced by TorchScript where it can (weights under 2 GB, opset up to 20); the dynamo exporter writes the rest: a 1.7B
decoder's 6.8 GB as one ``.data`` file (the tracer writes a file per tensor), and encoders, whose INT8 fusion
(``attention.fuse_attention``) matches dynamo's SDPA pattern. Both keep batch and sequence symbolic (a pruned
attention reshapes with -1, so no size is baked in) and give the same graph within float rounding; the tracer took
5.9 CPU s where dynamo took 19.7 (6 of SmolLM2-135M's 30 layers; ~3 CPU s a layer and graph, docs/BENCHMARKS.md
"Scale: time to artifact"). ``verify_text_onnx`` runs onnxruntime at shapes other than the traced one, with padding,
against PyTorch, and so does ``pipeline.export_verified`` for every graph it ships.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.exporters.onnx_export import (
    DEFAULT_OPSET,
    _quiet,
    add_metadata,
    append_metadata,
    check_onnx,
    external_weights,
    load_onnx,
)

INPUTS = ("input_ids", "attention_mask")
OUTPUT = "last_hidden_state"
LOGITS = "logits"
EXAMPLE = (2, 8)
"""Traced (batch, sequence): torch.export specialises sizes 0 and 1, which would pin an axis."""
TRACER, DYNAMO = "torchscript", "dynamo"
EXPORTERS = {
    TRACER: "torch.onnx.export(dynamo=False): the TorchScript tracer",
    DYNAMO: "torch.onnx.export(dynamo=True): torch.export and onnxscript's optimizer",
}
TRACER_MAX_OPSET = 20
VERIFY_SHAPES = ((1, 5), (3, 19))


class Encoder(nn.Module):
    """``model(input_ids, attention_mask).last_hidden_state`` as a plain two-tensor forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class CausalLM(nn.Module):
    """``model(input_ids, attention_mask).logits`` without a key/value cache: every position's next-token logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def graph(model: nn.Module) -> tuple[nn.Module, str]:
    """The module to export (on CPU, eval) and its output's name: logits for a model that generates (a causal
    LM head), the last hidden state otherwise."""
    model = model.to("cpu").eval()
    if type(model).can_generate():
        return CausalLM(model).eval(), LOGITS
    return Encoder(model).eval(), OUTPUT


def example_inputs(vocab: int, batch: int, seq: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random token ids; every sequence after the first is padded from a random length on."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    return ids, (torch.arange(seq)[None] < lengths[:, None]).long()


def exporter_for(module: nn.Module, opset: int) -> str:
    """``EXPORTERS``' key for ``module`` (``graph``'s): the tracer for a causal LM (seconds a decoder layer fewer)
    unless its weights need external data or the opset is past the tracer's; dynamo for the rest."""
    traced = isinstance(module, CausalLM) and opset <= TRACER_MAX_OPSET
    return TRACER if traced and not external_weights(module) else DYNAMO


def export_text_onnx(
    model: nn.Module, path: str | Path, opset: int = DEFAULT_OPSET, metadata: dict[str, Any] | None = None
) -> Path:
    """Export ``model`` (moved to CPU, eval) to ``path`` with ``exporter_for``'s exporter and check it; weights of 2 GB
    and more go to ``path.data`` (``onnx_export.external_weights``: a 1.7B decoder's 6.8 GB), written by the exporter
    straight from the tensors, the graph then rewritten alone with its metadata; a traced graph, weights inside, gets
    its metadata appended (``onnx_export.append_metadata``)."""
    onnx = require("onnx", "ONNX export")
    module, output = graph(model)
    exporter, external = exporter_for(module, opset), external_weights(module)
    example = example_inputs(model.config.vocab_size, *EXAMPLE)
    try:
        with _quiet():
            if exporter == TRACER:
                axes = {name: {0: "batch", 1: "sequence"} for name in (*INPUTS, output)}
                torch.onnx.export(
                    module,
                    example,
                    str(path),
                    input_names=list(INPUTS),
                    output_names=[output],
                    opset_version=opset,
                    dynamic_axes=axes,
                    dynamo=False,
                )
            else:
                batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
                program = torch.onnx.export(
                    module,
                    example,
                    input_names=list(INPUTS),
                    output_names=[output],
                    opset_version=opset,
                    dynamic_shapes={name: {0: batch, 1: seq} for name in INPUTS},
                    dynamo=True,
                    external_data=external,
                    optimize=False,  # run below, once the model's weights are known (``release_weights``)
                    verbose=False,
                )
                weights = list(program.model.graph.initializers.values())
                program.optimize()
                program.save(str(path), external_data=external)  # weights in f"{path.name}.data", one file
                release_weights([*weights, *program.model.graph.initializers.values()])
                del program, weights
                gc.collect()  # torch.export's and the ONNX IR's graphs are cyclic: what they hold of the model goes now
    except Exception as e:
        raise CorpError(f"ONNX export failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    metadata = {**(metadata or {}), "exporter": EXPORTERS[exporter]}
    if exporter == TRACER:  # the graph holds its weights: appended to, never parsed and written again
        append_metadata(path, metadata)
    else:
        proto = load_onnx(path, weights=False)
        add_metadata(proto, metadata)
        onnx.save(proto, str(path))  # external tensors keep their references: only the graph is rewritten
    check_onnx(path)
    return Path(path)


def release_weights(values: list[Any]) -> None:
    """Let go of the weights held by a saved dynamo ``ONNXProgram``'s ``values`` (its initializers before and after
    its optimizer), so that the model's can be freed after it.

    onnxscript's optimizer keeps nodes of the last graph it rewrote in its module-level rewrite rules (a pattern
    matcher's ``_graph`` and ``_current_node``). Their inputs are the model's own tensors (``TorchTensor``: the weights
    the optimizer replaced by their folded transposes, no longer in the graph) and views of them (the transposes): the
    model's weights stay reachable after the program is gone, and moving the model to the meta device
    (``pipeline.OneAtATime.free``) frees nothing. Measured on the 1.7B-wide shape cut to one layer (2026-12-02): the
    1.0 GiB of weights stayed resident after the free; with these values dropped it is returned."""
    for value in values:
        value.const_value = None


def verify_text_onnx(model: nn.Module, path: str | Path, shapes: tuple[tuple[int, int], ...] = VERIFY_SHAPES) -> float:
    """Largest |onnxruntime - PyTorch| / max |PyTorch| over real tokens at ``shapes`` (batch, sequence)."""
    ort = require("onnxruntime", "ONNX verification")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    module, output = graph(model)
    worst = 0.0
    for k, (batch, seq) in enumerate(shapes):
        ids, mask = example_inputs(model.config.vocab_size, batch, seq, seed=k + 1)
        with torch.inference_mode():
            ref = module(ids, mask).numpy()
        out = session.run([output], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        real = mask.numpy().astype(bool)
        worst = max(worst, float(np.abs(out - ref)[real].max() / np.abs(ref[real]).max()))
    return worst
