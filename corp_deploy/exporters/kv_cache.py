"""Decoders (every family with a ``genai_type``; dense or pruned) -> one decode-step ONNX graph with the KV cache.

The graph is what onnxruntime-genai runs token by token (``exporters.genai``): inputs ``input_ids``,
``attention_mask`` (batch x past+new), ``position_ids`` (rotary families: ``Adapter.positions``) and per layer
``past_key_values.{i}.key`` / ``.value`` (batch x K/V heads x past x width); outputs ``logits`` and
``present.{i}.key`` / ``.value`` (past+new long). One graph serves prefill (past length 0, empty tensors)
and decode; batch, sequence and past are dynamic, the widths are the layer's own, read from the model.

A pruned layer's K width (its Q/K width) and V width (its V width) differ, and differ between layers.
onnxruntime-genai 0.18 takes each layer's cache width from the graph's ``past_key_values.{i}.key`` dims and
allocates the value cache at that same width (a narrower V input is refused: "Got invalid dimensions for input:
past_key_values.0.value ... index: 3 Got: 8 Expected: 4"). ``CacheLayout`` therefore gives every layer one cache
width, the larger of its two, and the graph zero-pads the narrower of K and V up to it: zero K columns add
nothing to q.k, and the padding is sliced off before attention reads the cache, so the logits are exact; what it
costs is cache memory and bandwidth (``CacheLayout.padding``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.exporters.onnx_export import DEFAULT_OPSET, _quiet, add_metadata, check_onnx
from corp_deploy.families import Adapter, adapter_for, decoders

PAST, PRESENT = "past_key_values.{i}.{kind}", "present.{i}.{kind}"
KINDS = ("key", "value")
EXAMPLE = (2, 3, 4)
"""Traced (batch, new tokens, past tokens): torch.export specialises sizes 0 and 1, which would pin an axis."""
AXES = {"batch": "batch_size", "sequence": "sequence_length", "past": "past_sequence_length"}
TOTAL = "total_sequence_length"


@dataclass(frozen=True)
class CacheLayout:
    """Per layer: K/V heads, the model's K and V head widths, and whether the cache pads them to a common width.

    genai needs ``padded`` (each layer's cache the wider of its K and V); unpadded graphs run in onnxruntime
    itself, which is how the padding's cost is measured (studies/kv_padding.py)."""

    kv_heads: int
    key: tuple[int, ...]
    value: tuple[int, ...]
    padded: bool = True

    def stored(self, kind: str) -> tuple[int, ...]:
        """The cache widths of ``kind`` (``key`` or ``value``) per layer, as the graph stores them."""
        if self.padded:
            return tuple(max(k, v) for k, v in zip(self.key, self.value, strict=True))
        return self.key if kind == "key" else self.value

    @property
    def padding(self) -> dict[str, Any]:
        """What zero-padding costs: cache floats per token, stored against needed (all layers, one sequence)."""
        stored = self.kv_heads * sum(sum(self.stored(kind)) for kind in KINDS)
        needed = self.kv_heads * (sum(self.key) + sum(self.value))
        return {
            "padded_layers": [
                i for i, (k, v) in enumerate(zip(self.key, self.value, strict=True)) if self.padded and k != v
            ],
            "cache_floats_per_token": stored,
            "unpadded_floats_per_token": needed,
            "overhead": round(stored / needed - 1, 4),
        }

    def record(self) -> dict[str, Any]:
        caches = {f"{kind}_cache": self.stored(kind) for kind in KINDS}
        return {**asdict(self), **caches, "padding": self.padding}


def decoder(model: nn.Module) -> Adapter:
    """The family of a causal LM a decode graph is made for (one with a ``genai_type``); one line for any other.

    Whether the graph takes ``position_ids`` is the family's ``positions``: rotary positions come from the caller
    (``generate`` and genai count them over the mask); OPT's learned positions are counted over ``attention_mask``
    inside the model, exactly as ``generate`` does, so its graph needs no third input."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    try:
        family = adapter_for(model)
    except CorpError:
        family = None
    if family is None or family.genai_type is None or not type(model).can_generate():
        raise CorpError(
            f"a key/value-cache decoder graph is made for causal LMs of {decoders()}, not {kind or type(model)}"
        )
    return family


def layout(model: nn.Module, padded: bool = True) -> CacheLayout:
    """The cache layout read from the model: each layer's K and V widths are its Q/K and V head widths."""
    family, config = decoder(model), model.config
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    widths = [family.head_widths(block) for block in family.blocks(model)]
    return CacheLayout(kv, tuple(k for k, _ in widths), tuple(v for _, v in widths), padded)


def _cache(past: Sequence[Tensor], lay: CacheLayout) -> Any:
    """A ``transformers`` ``DynamicCache`` over the graph's past inputs.

    The model's own cache object, not a re-implemented attention: the pruned and dense attention modules call
    ``cache.update`` as they do in ``generate``, so the graph computes what ``generate`` computes. Each layer's
    ``update`` concatenates the new K/V (zero-padded to the layer's cache width) to the past and returns the
    real widths to attention; ``present`` is the padded concatenation.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class Layer(DynamicLayer):
        def __init__(self, keys: Tensor, values: Tensor, key: int, value: int) -> None:
            super().__init__()
            self.keys, self.values, self.key, self.value = keys, values, key, value
            self.device, self.is_initialized = keys.device, True

        def update(self, keys: Tensor, values: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            self.keys = torch.cat([self.keys, _pad(keys, self.keys.shape[-1])], dim=-2)
            self.values = torch.cat([self.values, _pad(values, self.values.shape[-1])], dim=-2)
            return self.keys[..., : self.key], self.values[..., : self.value]

    cache = DynamicCache()
    cache.layers = [
        Layer(past[2 * i], past[2 * i + 1], k, v) for i, (k, v) in enumerate(zip(lay.key, lay.value, strict=True))
    ]
    return cache


def _pad(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class DecodeStep(nn.Module):
    """``(input_ids, attention_mask[, position_ids], *past) -> (logits, *present)``: one forward of the model with
    its key/value cache as flat tensors, in the order ``names`` gives."""

    def __init__(self, model: nn.Module, padded: bool = True) -> None:
        super().__init__()
        self.model, self.lay, self.family = model, layout(model, padded), decoder(model)
        self.positions = self.family.positions

    def forward(self, input_ids: Tensor, attention_mask: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        positions, past = (rest[0], rest[1:]) if self.positions else (None, rest)
        cache = _cache(past, self.lay)
        kw = {"position_ids": positions} if self.positions else {}
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True, **kw)
        return (logits.logits, *(t for layer in cache.layers for t in (layer.keys, layer.values)))

    def names(self) -> tuple[list[str], list[str]]:
        """(input names, output names) of the graph."""
        layers = range(len(self.lay.key))
        cache = [(i, kind) for i in layers for kind in KINDS]
        inputs = ["input_ids", "attention_mask", *(["position_ids"] if self.positions else [])]
        return (
            inputs + [PAST.format(i=i, kind=k) for i, k in cache],
            ["logits"] + [PRESENT.format(i=i, kind=k) for i, k in cache],
        )

    def empty_past(self, batch: int, past: int = 0) -> list[Tensor]:
        """Zero past K/V of ``past`` tokens at the layout's widths (``past`` 0: the prefill's empty tensors)."""
        widths = zip(*(self.lay.stored(kind) for kind in KINDS), strict=True)
        return [torch.zeros(batch, self.lay.kv_heads, past, w) for layer in widths for w in layer]


def positions(mask: Tensor) -> Tensor:
    """Position ids over a left-padded mask, as ``generate`` counts them (padding gets 1, never read)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _example(step: DecodeStep, vocab: int) -> tuple[Tensor, ...]:
    batch, new, past = EXAMPLE
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, new), generator=g)
    mask = torch.ones(batch, past + new, dtype=torch.long)
    pos = (positions(mask)[:, past:],) if step.positions else ()
    return (ids, mask, *pos, *(torch.randn(t.shape, generator=g) for t in step.empty_past(batch, past)))


def export_decoder_onnx(
    model: nn.Module,
    path: str | Path,
    opset: int = DEFAULT_OPSET,
    metadata: dict[str, Any] | None = None,
    padded: bool = True,
) -> DecodeStep:
    """Export ``model``'s decode step (moved to CPU, eval) to ``path`` (weights inside, < 2 GB), checked by
    ``onnx.checker``; the graph's symbolic axes are renamed to what genai's own graphs call them."""
    onnx = require("onnx", "ONNX export")
    step = DecodeStep(model.to("cpu").eval(), padded).eval()
    inputs, outputs = step.names()
    dyn = torch.export.Dim.DYNAMIC
    past = [{0: dyn, 2: dyn}] * (2 * len(step.lay.key))
    rest = ([{0: dyn, 1: dyn}] if step.positions else []) + past  # ``*rest``: positions and the past, one tuple
    shapes = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, tuple(rest))
    try:
        with _quiet(), torch.no_grad():
            program = torch.onnx.export(
                step,
                _example(step, model.config.vocab_size),
                input_names=inputs,
                output_names=outputs,
                opset_version=opset,
                dynamic_shapes=shapes,
                dynamo=True,
                external_data=False,
                verbose=False,
            )
    except Exception as e:
        raise CorpError(
            f"ONNX export of the decode step failed: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from None
    proto = program.model_proto
    _name_axes(proto)
    add_metadata(proto, {**(metadata or {}), "kv_cache": step.lay.record()})
    onnx.save(proto, str(path))
    check_onnx(path)
    return step


def _name_axes(proto: Any) -> None:
    """Symbolic dims as genai's builder names them (the exporter's are ``s10``, ``s43``...): readable in Netron."""
    graph = proto.graph
    for value in (*graph.input, *graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.name in ("input_ids", "position_ids", "logits"):
            names = [AXES["batch"], AXES["sequence"], None][: len(dims)]
        elif value.name == "attention_mask":
            names = [AXES["batch"], TOTAL]
        else:
            names = [AXES["batch"], None, AXES["past"] if value.name.startswith("past") else TOTAL, None]
        for dim, name in zip(dims, names, strict=True):
            if name is not None and dim.HasField("dim_param"):
                dim.dim_param = name


# ------------------------------------------------------------------------------------------- verification

VERIFY_PROMPTS = (7, 4)
"""Prompt lengths of the verification batch: the shorter one is left-padded, as genai pads a batch."""


def _reference_steps(model: nn.Module, ids: Tensor, mask: Tensor, steps: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``(input_ids, attention_mask, logits)`` of a greedy prefill + ``steps`` decode steps of the torch model
    with its own key/value cache (what ``generate`` runs)."""
    family, out, cache, calls = decoder(model), None, None, []
    for _ in range(steps + 1):
        if out is not None:
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
        kw = {"position_ids": positions(mask)[:, -ids.shape[1] :]} if family.positions else {}
        out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, **kw)
        cache = out.cache
        calls.append((ids, mask, out.logits))
    return calls


@dataclass(frozen=True)
class DecodeReference:
    """torch's logits over a prefill and decode steps (``decode_references``), kept to check a graph with
    (``check_decode_steps``) once the model is let go: the 1.7B shape's float32 weights (6.4 GiB) and an onnxruntime
    session of its graph (as much again) are never held together."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    calls: tuple[tuple[tuple[dict[str, np.ndarray], list[tuple[np.ndarray, np.ndarray, np.ndarray]]], ...], ...]
    """Per prompt batch: (its empty past by input name, each call's (input_ids, attention_mask, logits))."""
    steps: int
    batched: bool


def decode_references(
    model: nn.Module, steps: int = 4, seed: int = 0, padded: bool = True, batched: bool = True
) -> DecodeReference:
    """The torch model's own prefill + ``steps`` greedy decode steps on the ``VERIFY_PROMPTS`` (in one left-padded
    batch, or one at a time unless ``batched``: the builder's attention reads a mask's padding on the right, as
    genai feeds it, not ``generate``'s left padding), with its own key/value cache: what ``check_decode_steps``
    compares a graph with."""
    step = DecodeStep(model, padded)
    names, outputs = step.names()
    groups = []
    for lengths in [VERIFY_PROMPTS] if batched else [(n,) for n in VERIFY_PROMPTS]:
        g = torch.Generator().manual_seed(seed)
        longest = max(lengths)
        ids = torch.randint(0, model.config.vocab_size, (len(lengths), longest), generator=g)
        mask = (torch.arange(longest)[None] >= torch.tensor([longest - n for n in lengths])[:, None]).long()
        with torch.inference_mode():
            calls = [(i.numpy(), m.numpy(), z.numpy()) for i, m, z in _reference_steps(model, ids, mask, steps)]
        empty = step.empty_past(len(lengths))
        past = {n: t.numpy() for n, t in zip(names[-2 * len(step.lay.key) :], empty, strict=True)}
        groups.append((past, calls))
    return DecodeReference(tuple(names), tuple(outputs), tuple(groups), steps, batched)


def check_decode_steps(reference: DecodeReference, path: str | Path) -> dict[str, Any]:
    """The graph at ``path`` in onnxruntime over ``reference``'s calls, each step's past fed from the last step's
    present: the largest |onnxruntime - torch| / max |torch| over real tokens, per step. Inputs and outputs are
    matched by name, so any decode-step graph with genai's names is checked (``export_decoder_onnx``'s, and genai's
    builder's, which counts positions itself and takes no ``position_ids``)."""
    ort = require("onnxruntime", "ONNX verification")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    wanted, outputs = {i.name for i in session.get_inputs()}, list(reference.outputs)
    errors = [0.0] * (reference.steps + 1)
    for past, calls in reference.calls:
        for k, (ids, mask, ref) in enumerate(calls):
            feeds = {"input_ids": ids, "attention_mask": mask, **past}
            feeds["position_ids"] = positions(torch.from_numpy(mask))[:, -ids.shape[1] :].numpy()
            try:
                run = session.run(outputs, {k_: v for k_, v in feeds.items() if k_ in wanted})
            except Exception as e:  # onnxruntime's own exception types
                raise CorpError(f"onnxruntime cannot run the decode-step graph: {first_line(e)}") from None
            got = dict(zip(outputs, run, strict=True))
            past = {name.replace("present", "past_key_values", 1): got[name] for name in outputs[1:]}
            real = mask[:, -ids.shape[1] :].astype(bool)
            errors[k] = max(errors[k], float(np.abs(got["logits"] - ref)[real].max() / np.abs(ref[real]).max()))
    return {
        "prompt_lengths": list(VERIFY_PROMPTS),
        "batched": reference.batched,
        "decode_steps": reference.steps,
        "max_rel_error_per_step": errors,
    }


def verify_decoder_onnx(
    model: nn.Module, path: str | Path, steps: int = 4, seed: int = 0, padded: bool = True, batched: bool = True
) -> dict[str, Any]:
    """``check_decode_steps`` of the graph at ``path`` against ``model``'s ``decode_references``, the model held."""
    return check_decode_steps(decode_references(model, steps, seed, padded, batched), path)
