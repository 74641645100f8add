"""A decoder's decode-step graph as onnxruntime-genai's own model builder writes it: fused operators.

``torch.export`` writes a decode step as ~90 small nodes a layer (the RMSNorm, rotary embedding, cache
concatenation and attention unfused): on a 2-core CPU those, not the weight GEMMs, are most of an INT4 step's time
(docs/BENCHMARKS.md, "Where the INT4 decode step's time goes"). genai's builder
(``onnxruntime_genai.models.builder``) writes the same model as ~10 nodes a layer: ``SkipSimplifiedLayerNormalization``,
one packed Q/K/V MatMul, ``GroupQueryAttention`` (rotary, cache update and attention in one op, the cache buffer
shared between past and present). The builder reads a ``transformers`` folder (it loads the model itself with
``from_pretrained`` and holds it, about the float32 weights, while it writes the graph): the model's own folder on
disk where there is one (a dense source folder, a run's ``pruned/`` artifact), else the model written as its prune
artifact into a temporary folder first (``artifact.save_pruned``: the standard form, or the remote-code form for
per-layer MLP widths, which the builder loads with ``trust_remote_code``). The caller's model is let go (``free``)
before the builder runs, so two copies of the weights are never held.

What the builder cannot take (``unsupported``): a family it has no builder for (OPT), and attention whose Q/K and V
head widths differ from the config's (``GroupQueryAttention`` has one head size for Q, K and V; a per-layer head
width has no place in its packed Q/K/V). Those keep ``exporters.kv_cache``'s graph, which takes any widths.
"""

from __future__ import annotations

import contextlib
import gc
import io
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.exporters.kv_cache import KINDS, PAST, PRESENT, layout
from corp_deploy.exporters.onnx_export import add_metadata, check_onnx
from corp_deploy.formats.artifact import save_pruned

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""The builder's architectures that corp-deploy's decoder families are (and that its tests build)."""
HEAD_MULTIPLE = 16
"""onnxruntime 1.32's CPU GroupQueryAttention: "head_size shall be a multiple of 16"."""


def unsupported(model: nn.Module, tokenizer: Sequence[Path]) -> str | None:
    """Why the builder cannot write ``model``'s decode step (with these ``tokenizer`` files), in one line; None
    when it can."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"onnxruntime-genai's model builder has no {name} (it builds {', '.join(ARCHITECTURES)} here)"
    if not any(f.name == "tokenizer.json" for f in tokenizer):
        return "no tokenizer.json beside the model (the builder reads the tokenizer)"
    if window := sliding_window(model.config):
        return (
            f"sliding-window attention (window {window}): the builder's GroupQueryAttention windows the cache "
            "otherwise than transformers (measured: its logits differ)"
        )
    from corp_deploy.families.hf.folder import dense_head  # transformers: the text extra, read only for decoders

    lay, head = layout(model), dense_head(model.config)
    if head % HEAD_MULTIPLE:
        return f"its heads are {head} wide: GroupQueryAttention on the CPU takes multiples of {HEAD_MULTIPLE}"
    for i, (k, v) in enumerate(zip(lay.key, lay.value, strict=True)):
        if (k, v) != (head, head):
            return (
                f"layer {i}'s attention heads are {k} wide for Q/K and {v} for V: GroupQueryAttention takes one head "
                f"size ({head})"
            )
    return None


def sliding_window(config: Any) -> int | None:
    """The window of a config whose attention slides (Mistral's ``sliding_window``, Qwen2's when
    ``use_sliding_window``), else None."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


def builder_folder(folder: Path | None, tokenizer: Sequence[Path]) -> Path | None:
    """``folder`` where the builder can read the model from it as it is (a ``config.json`` and every one of the
    ``tokenizer`` files beside it), else None: the model is then written for it (``build_fused``)."""
    if folder is None or not (folder / "config.json").is_file():
        return None
    return folder if all((folder / f.name).is_file() for f in tokenizer) else None


def build_fused(
    model: nn.Module,
    folder: Path,
    metadata: dict[str, Any],
    tokenizer: Sequence[Path],
    precision: str = "fp32",
    options: Sequence[str] = (),
    source: Path | None = None,
    free: Callable[[], None] = lambda: None,
) -> None:
    """Write ``model``'s decode step with genai's builder into ``folder`` (``model.onnx`` + ``.data``,
    ``genai_config.json``, the ``tokenizer`` files, which the builder reads): FP32, or ``precision`` int4 with the
    builder's weight-only ``options`` (its ``--extra_options``: ``exporters.int4.RECIPES``). The builder reads
    ``source``, the model's ``transformers`` folder, where it can (``builder_folder``), else a copy written here;
    ``free`` is called once the model is no longer needed (the copy written), before the builder loads its own. The
    graph gets corp-deploy's metadata and concrete cache widths (``_finish``)."""
    if why := unsupported(model, tokenizer):
        raise CorpError(f"genai's model builder cannot write this model: {why}")
    lay = layout(model, padded=False)
    cache = {
        template.format(i=i, kind=kind): (lay.kv_heads, width)
        for template in (PAST, PRESENT)
        for kind in KINDS
        for i, width in enumerate(lay.stored(kind))
    }
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".hf-") as tmp:
        read = builder_folder(source, tokenizer)
        if read is None:
            read = Path(tmp) / "model"
            save_pruned(model, read, {"model": {"name": str(read), "args": {}}})  # the artifact is the HF folder
            for f in tokenizer:
                shutil.copy2(f, read / f.name)
        free()
        build_from_folder(read, folder, {**metadata, "kv_cache": lay.record()}, cache, precision, options)


def build_from_folder(
    source: Path,
    folder: Path,
    metadata: dict[str, Any],
    cache: dict[str, tuple[int, int]],
    precision: str = "fp32",
    options: Sequence[str] = (),
) -> None:
    """genai's builder on the ``transformers`` folder ``source`` (with its tokenizer) into ``folder``; the graph's
    cache inputs and outputs pinned to ``cache`` (name -> (K/V heads, width)) and ``metadata`` added. The builder's
    own printing is swallowed; its failure is one line."""
    builder = require("onnxruntime_genai.models.builder", "a fused decode-step graph")
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".cache-") as tmp:
        args = (None, str(source), str(folder), precision, "cpu", tmp)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                parsed = builder.parse_extra_options(*args, ["hf_token=false", "hf_remote=true", *options])
                builder.create_model(*args, **parsed)
        except Exception as e:  # the builder raises bare Exceptions of every kind
            raise CorpError(f"onnxruntime-genai's model builder failed: {type(e).__name__}: {first_line(e)}") from None
        finally:  # the builder's objects hold its model in reference cycles: 6.4 GiB at the 1.7B shape, beside the
            gc.collect()  # onnxruntime session that checks the graph next unless collected now (measured)
    _finish(folder / "model.onnx", cache, metadata)


def cache_dims(graph: Path) -> dict[str, tuple[int, int]]:
    """The pinned (K/V heads, width) of every cache input and output of a decode-step graph (``_finish``'s): an INT4
    graph built from the model's folder takes its FP32 graph's."""
    onnx = require("onnx", "a fused decode-step graph")
    proto = onnx.load(str(graph), load_external_data=False)
    return {
        v.name: (v.type.tensor_type.shape.dim[1].dim_value, v.type.tensor_type.shape.dim[3].dim_value)
        for v in (*proto.graph.input, *proto.graph.output)
        if v.name.startswith(("past_key_values.", "present."))
    }


def _finish(path: Path, cache: dict[str, tuple[int, int]], metadata: dict[str, Any]) -> None:
    """Pin the cache inputs' and outputs' head and width dims (the builder leaves them symbolic; genai and the INT4
    gate read them from the graph), drop the builder's intermediate shape annotations (they carry the config's one MLP
    width, wrong for per-layer widths), add the metadata; weights stay in ``.data``."""
    onnx = require("onnx", "a fused decode-step graph")
    proto = onnx.load(str(path), load_external_data=False)
    for value in (*proto.graph.input, *proto.graph.output):
        if value.name in cache:
            dims = value.type.tensor_type.shape.dim
            dims[1].dim_value, dims[3].dim_value = cache[value.name]
    del proto.graph.value_info[:]
    add_metadata(proto, metadata)
    onnx.save(proto, str(path))
    check_onnx(path)
