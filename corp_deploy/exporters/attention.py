"""Attention as one ``com.microsoft.MultiHeadAttention`` node: the exported encoder's attention, fused exactly.

torch's exporter writes scaled-dot-product attention as a dozen nodes per layer: Q, K and V each reshaped to heads and
transposed, Q and K each scaled by sqrt(scale), the padding mask turned into an additive ``Where(mask, 0, -max)``,
MatMul, Add, Softmax, a NaN guard, MatMul, transpose and reshape back. onnxruntime's transformer optimizer matches
none of it (its patterns expect ``(1 - mask) * -10000`` and Q K^T scaled after the MatMul), so every layer pays those
nodes' memory traffic over the [batch, heads, seq, seq] scores, and ``quantize_dynamic`` turns the two activation
MatMuls into dynamically quantized ones. ``fuse_attention`` replaces each layer's chain, from the Q/K/V projections'
outputs to the merged-heads output, by ``MultiHeadAttention(q, k, v, key_padding_mask)``:

- the heads come from the graph's own reshape (``[B, S, heads, -1]`` or ``[B, S, -1, head_dim]``), the widths from
  the projections (separate, as BERT's, or one packed ``qkv`` split in three, as timm's), so per-layer pruned widths
  and unequal Q/K and V widths (the op's ``v_hidden_size``) fuse alike;
- the scale is the product of the scalar factors on the Q and K paths (written explicitly: the op's default is
  1/sqrt(head size), which a pruned Q/K head size would change);
- the mask is the graph's ``attention_mask`` input as the key padding mask, taken only where the scores' additive
  term is computed from that input alone (a bidirectional encoder's padding mask); a graph without a mask (a ViT)
  fuses without one.

What it rewrites is checked, not trusted: ``int8_recipes.check_fused`` keeps the fused graph only where it matches the
FP32 graph within the FP32 tolerance on the held-out data (on MiniLM it matches to the bit), and a layer whose chain
has any other shape is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper, numpy_helper

MASK_INPUT = "attention_mask"
LAYOUT = ("Reshape", "Transpose")


class _Graph:
    """Producers, consumers and constants of one graph, read once."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[NodeProto]] = {}
        for n in graph.node:
            for name in n.input:
                self.consumers.setdefault(name, []).append(n)
        self.initializers = {i.name: i for i in graph.initializer}

    def const(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def scalar(self, name: str) -> float | None:
        value = self.const(name)
        return float(value.ravel()[0]) if value is not None and value.size == 1 else None

    def inputs_above(self, name: str) -> set[str]:
        """The graph inputs ``name`` is computed from."""
        graph_inputs = {i.name for i in self.graph.input}
        seen, stack, found = set(), [name], set()
        while stack:
            x = stack.pop()
            if x in seen or not x:
                continue
            seen.add(x)
            if x in graph_inputs:
                found.add(x)
            node = self.producer.get(x)
            if node is not None:
                stack.extend(node.input)
        return found


def _projection(g: _Graph, name: str) -> tuple[str, float, list[NodeProto]]:
    """Walk back from a head-split tensor through layout ops and scalar factors to the projection output:
    (its name, the product of the factors, the reshapes passed)."""
    scale, reshapes = 1.0, []
    while (node := g.producer.get(name)) is not None:
        if node.op_type in LAYOUT:
            reshapes += [node] if node.op_type == "Reshape" else []
        elif node.op_type in ("Mul", "Div") and (c := g.scalar(node.input[1])) is not None:
            scale = scale * c if node.op_type == "Mul" else scale / c
        else:
            break
        name = node.input[0]
    return name, scale, reshapes


def _width(g: _Graph, projection: str) -> int | None:
    """The output width of a projection ``MatMul(x, W) (+ b)`` whose weight is an initializer, or of one part of
    a packed projection ``Split`` by constant sizes (timm's ``qkv``)."""
    node = g.producer.get(projection)
    if node is not None and node.op_type == "Split" and len(node.input) > 1:
        sizes = g.const(node.input[1])
        return int(sizes[list(node.output).index(projection)]) if sizes is not None else None
    if node is not None and node.op_type == "Add":
        node = next((g.producer[i] for i in node.input if i in g.producer and g.producer[i].op_type == "MatMul"), None)
    weight = g.initializers.get(node.input[1]) if node is not None and node.op_type == "MatMul" else None
    return int(weight.dims[-1]) if weight is not None and len(weight.dims) == 2 else None


def _heads(g: _Graph, reshapes: list[NodeProto], width: int) -> int | None:
    """Heads from the split reshape's target ``[B, S, heads, -1]`` or ``[B, S, -1, head_dim]`` (or all constant, as
    a fixed-size image graph writes it)."""
    for reshape in reshapes:
        target = g.const(reshape.input[1])
        shape = g.producer.get(reshape.input[1])
        if target is not None and target.size == 4:
            heads, head_dim = int(target[2]), int(target[3])
        elif shape is not None and shape.op_type == "Concat" and len(shape.input) == 4:
            heads, head_dim = g.scalar(shape.input[2]), g.scalar(shape.input[3])
        else:
            continue
        if heads is not None and heads > 0:
            return int(heads)
        if heads == -1 and head_dim is not None and head_dim > 0 and width % int(head_dim) == 0:
            return width // int(head_dim)
    return None


def _merged_output(g: _Graph, name: str) -> str | None:
    """Follow the attention output through its single-consumer transpose and reshapes back to [B, S, heads * dv]."""
    passed = []
    while len(users := g.consumers.get(name, [])) == 1 and users[0].op_type in LAYOUT:
        passed.append(users[0].op_type)
        name = users[0].output[0]
    return name if passed.count("Transpose") == 1 and passed[-1:] == ["Reshape"] else None


def _unbound(g: _Graph, name: str) -> tuple[str, int, int, int] | None:
    """timm's dense attention: ``qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)``, each part a
    Slice + Squeeze (or Gather) on axis 0: (the packed projection, the part, H, D), else None."""
    node = g.producer.get(name)
    if node is not None and node.op_type == "Squeeze":
        node = g.producer.get(node.input[0])
        if node is None or node.op_type != "Slice" or len(node.input) < 4 or g.scalar(node.input[3]) != 0:
            return None
    elif node is None or node.op_type != "Gather" or any(a.name == "axis" and a.i != 0 for a in node.attribute):
        return None
    part, permute = g.scalar(node.input[1]), g.producer.get(node.input[0])
    if part is None or permute is None or permute.op_type != "Transpose":
        return None
    if list(permute.attribute[0].ints) != [2, 0, 3, 1, 4] or (reshape := g.producer.get(permute.input[0])) is None:
        return None
    target = g.const(reshape.input[1]) if reshape.op_type == "Reshape" else None
    if target is None or target.size != 5 or int(target[2]) != 3 or min(int(target[3]), int(target[4])) < 1:
        return None
    return reshape.input[0], int(part), int(target[3]), int(target[4])


def _layers(g: _Graph, has_mask: bool, splits: dict[str, int]) -> Iterator[NodeProto]:
    """One ``MultiHeadAttention`` per attention chain that has exactly the exported shape; a packed projection
    read through ``unbind`` is recorded in ``splits`` (its name -> one part's width) to be split in three."""
    for softmax in [n for n in g.graph.node if n.op_type == "Softmax"]:
        scores, mask = g.producer.get(softmax.input[0]), ""
        if scores is not None and scores.op_type == "Add":
            bias = scores.input[1]
            if not has_mask or g.inputs_above(bias) != {MASK_INPUT}:
                continue
            scores, mask = g.producer.get(scores.input[0]), MASK_INPUT + "_int32"
        if scores is None or scores.op_type != "MatMul":
            continue
        probs = softmax.output[0]
        guard = [u for u in g.consumers.get(probs, []) if u.op_type == "Where"]  # the fully-masked-row NaN guard
        after = [u for u in g.consumers.get(guard[0].output[0] if guard else probs, []) if u.op_type == "MatMul"]
        if len(after) != 1:
            continue
        (q, q_scale, q_reshapes), (k, k_scale, _), (v, v_scale, _) = (
            _projection(g, scores.input[0]),
            _projection(g, scores.input[1]),
            _projection(g, after[0].input[1]),
        )
        packed = [_unbound(g, x) for x in (q, k, v)]
        if all(packed) and len({p[0] for p in packed}) == 1 and [p[1] for p in packed] == [0, 1, 2]:
            source, _, heads, head_dim = packed[0]
            splits[source] = heads * head_dim
            q, k, v = (f"{source}/{part}" for part in "qkv")
            width = v_width = heads * head_dim
        else:
            width, v_width = _width(g, q), _width(g, v)
            heads = _heads(g, q_reshapes, width) if width is not None and width == _width(g, k) else None
        out = _merged_output(g, after[0].output[0])
        if None in (heads, v_width, out) or v_scale != 1.0 or width % heads or v_width % heads:
            continue
        yield helper.make_node(
            "MultiHeadAttention",
            [q, k, v, "", mask],
            [out],
            name=f"{out}/MultiHeadAttention",
            domain="com.microsoft",
            num_heads=heads,
            scale=q_scale * k_scale,
        )


def _live_sorted(graph: onnx.GraphProto, nodes: list[NodeProto]) -> list[NodeProto]:
    """The nodes the outputs need, in an order where each follows what it reads."""
    producer = {o: n for n in nodes for o in n.output}
    live: dict[int, NodeProto] = {}
    stack = [o.name for o in graph.output]
    while stack:
        node = producer.get(stack.pop())
        if node is not None and id(node) not in live:
            live[id(node)] = node
            stack.extend(i for i in node.input if i)
    ready = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    ordered, pending = [], [n for n in nodes if id(n) in live]
    while pending:
        rest = []
        for n in pending:
            if all(i in ready for i in n.input):
                ordered.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ValueError("the rewritten graph has a cycle")
        pending = rest
    return ordered


def fuse_attention(model: onnx.ModelProto) -> int:
    """Rewrite every exported attention chain of ``model`` (in place) as one ``MultiHeadAttention``; returns how
    many. The nodes only the old chains used, and their initializers, are dropped."""
    g = _Graph(model.graph)
    has_mask = MASK_INPUT in {i.name for i in model.graph.input}
    splits: dict[str, int] = {}
    fused = list(_layers(g, has_mask, splits))
    if not fused:
        return 0
    replaced = {n.output[0] for n in fused}
    kept = [n for n in model.graph.node if not replaced.intersection(n.output)]
    for source, width in splits.items():
        sizes = numpy_helper.from_array(np.array([width] * 3, np.int64), f"{source}/split_sizes")
        model.graph.initializer.append(sizes)
        kept.append(helper.make_node("Split", [source, sizes.name], [f"{source}/{p}" for p in "qkv"], axis=-1))
    if any(n.input[4] for n in fused):
        kept.append(helper.make_node("Cast", [MASK_INPUT], [MASK_INPUT + "_int32"], to=TensorProto.INT32))
    nodes = _live_sorted(model.graph, kept + fused)
    used = {i for n in nodes for i in n.input}
    initializers = [i for i in model.graph.initializer if i.name in used]
    produced = {o for n in nodes for o in n.output}
    value_info = [v for v in model.graph.value_info if v.name in produced]
    del model.graph.node[:], model.graph.initializer[:], model.graph.value_info[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(initializers)
    model.graph.value_info.extend(value_info)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(fused)
