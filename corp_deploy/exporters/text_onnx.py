"""Text models (``transformers``, dense or pruned) -> ONNX with dynamic batch AND sequence, verified.

The graph takes ``input_ids`` and ``attention_mask`` (int64, batch x sequence) and returns an encoder's
``last_hidden_state`` (pooling stays with the caller, as with sentence-transformers) or a causal LM's
``logits`` (the full-sequence forward, no key/value cache: scoring and prefill, not token-by-token decoding).
The dynamo exporter keeps both axes symbolic (a pruned attention reshapes with -1, so no size is baked in);
``verify_text_onnx`` runs onnxruntime at shapes other than the traced one, with padding, against PyTorch.
"""

from __future__ import annotations

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
    check_onnx,
    external_weights,
    load_onnx,
)

INPUTS = ("input_ids", "attention_mask")
OUTPUT = "last_hidden_state"
LOGITS = "logits"
EXAMPLE = (2, 8)
"""Traced (batch, sequence): torch.export specialises sizes 0 and 1, which would pin an axis."""
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


def export_text_onnx(
    model: nn.Module, path: str | Path, opset: int = DEFAULT_OPSET, metadata: dict[str, Any] | None = None
) -> Path:
    """Export ``model`` (moved to CPU, eval) to ``path`` and check it; weights of 2 GB and more go to ``path.data``
    (``onnx_export.external_weights``: a 1.7B decoder's 6.8 GB), written by the exporter straight from the tensors,
    the graph then rewritten alone with its metadata."""
    onnx = require("onnx", "ONNX export")
    module, output = graph(model)
    external = external_weights(module)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    try:
        with _quiet():
            program = torch.onnx.export(
                module,
                example_inputs(model.config.vocab_size, *EXAMPLE),
                input_names=list(INPUTS),
                output_names=[output],
                opset_version=opset,
                dynamic_shapes={name: {0: batch, 1: seq} for name in INPUTS},
                dynamo=True,
                external_data=external,
                verbose=False,
            )
    except Exception as e:
        raise CorpError(f"ONNX export failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    if external:
        program.save(str(path), external_data=True)  # the weights in f"{path.name}.data", as onnx_files expects
        proto = load_onnx(path, weights=False)
    else:
        proto = program.model_proto
    add_metadata(proto, metadata or {})
    onnx.save(proto, str(path))  # external tensors keep their references: only the graph is rewritten
    check_onnx(path)
    return Path(path)


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
