"""The prune artifact: ``model.safetensors`` + ``corp.json``, written atomically, reloadable alone.

``corp.json`` records the timm name, model args and per-block widths, which is everything needed to
rebuild the module tree; the weights then load strictly. No calibration data, no surgery replay.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import timm
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from corp_deploy.errors import CorpError, first_line
from corp_deploy.surgery import apply_widths, block_widths

FORMAT = "corp-deploy/pruned-vit"
FORMAT_VERSION = 2
"""2: ``structure`` records each block's ``v_dim``; version 1 artifacts (V never pruned) still load."""
WEIGHTS_FILE = "model.safetensors"
META_FILE = "corp.json"


def cache_dir() -> Path:
    """Where corp-deploy keeps what is costly to remake and safe to share: ``$XDG_CACHE_HOME/corp-deploy``."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "corp-deploy"


def check_writable(out: str | Path, overwrite: bool) -> None:
    """Fail before any work when ``out`` exists and may not be replaced."""
    if Path(out).exists() and not overwrite:
        raise CorpError(f"output {out} already exists; choose another --out or pass --overwrite")


@contextmanager
def staged(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; what is written there moves next to ``out`` on success.

    For a file with companions (``x.onnx`` + ``x.onnx.data`` + ``x.onnx.json``, an engine and its
    sidecar): write them under their final names; the companions move first and ``out`` last, so
    ``out`` never appears without them. On failure nothing moves, the folder is removed, and an
    existing ``out`` is left untouched.
    """
    out = Path(out)
    check_writable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield stage
        if not (stage / out.name).exists():
            raise RuntimeError(f"staged output {out.name} was not written")
        _chmod_default(stage)
        for f in sorted(stage.iterdir(), key=lambda f: f.name == out.name):
            _replace(f, out.parent / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _replace(src: Path, dst: Path) -> None:
    """``os.replace`` that also replaces an existing folder (moved aside first, then deleted)."""
    if not (dst.is_dir() and not dst.is_symlink()):
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / dst.name)
    try:
        os.replace(src, dst)
    except BaseException:
        os.replace(old / dst.name, dst)  # the new one could not move in: the old one goes back
        old.rmdir()
        raise
    shutil.rmtree(old)


@contextmanager
def atomic_file(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path that becomes ``out`` only if the block completes."""
    with staged(out, overwrite) as stage:
        yield stage / Path(out).name


@contextmanager
def atomic_dir(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``out`` only if the block completes."""
    with atomic_file(out, overwrite) as tmp:
        tmp.mkdir()
        yield tmp


def _chmod_default(folder: Path) -> None:
    """mkdtemp makes private folders; give the finished artifact the permissions the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


def save_pruned(model: nn.Module, out: str | Path, meta: dict[str, Any], overwrite: bool = False) -> Path:
    """Write ``model`` and its description to ``out`` atomically.

    ``meta`` must hold ``model: {name, args}``; the per-block widths are taken from the model itself.
    """
    record = {"format": FORMAT, "format_version": FORMAT_VERSION, **meta, "structure": block_widths(model)}
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    try:
        with atomic_dir(out, overwrite) as tmp:
            save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
            (tmp / META_FILE).write_text(json.dumps(record, indent=2) + "\n")
    except OSError as e:
        raise CorpError(f"could not write {out} ({first_line(e)}); whatever was there is unchanged") from None
    return Path(out)


def read_meta(path: str | Path) -> dict[str, Any]:
    """``corp.json`` of an artifact folder, checked to be one this version can load."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise CorpError(f"{path} is not a corp-deploy prune artifact (no {META_FILE}); run `corp-deploy prune` first")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CorpError(f"{meta_path} is corrupt ({e}); re-run `corp-deploy prune`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("format_version", 0) > FORMAT_VERSION:
        raise CorpError(f"{meta_path} is not a prune artifact this corp-deploy version reads; upgrade or re-prune")
    model = meta.get("model")
    if not (
        isinstance(model, dict)
        and isinstance(model.get("name"), str)
        and isinstance(model.get("args", {}), dict)
        and isinstance(meta.get("structure"), list)
    ):
        raise CorpError(f"{meta_path} lacks the model name, arguments or structure; re-run `corp-deploy prune`")
    return meta


def load_pruned(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a pruned model (eval mode) from an artifact folder, without calibration data."""
    meta = read_meta(path)
    try:
        model = timm.create_model(meta["model"]["name"], pretrained=False, **meta["model"].get("args", {}))
        apply_widths(model, meta["structure"])
    except (RuntimeError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise CorpError(
            f"{Path(path) / META_FILE} describes a model this corp-deploy cannot build ({first_line(e)}); "
            "re-run `corp-deploy prune`"
        ) from None
    try:
        model.load_state_dict(load_file(str(Path(path) / WEIGHTS_FILE)))
    except (RuntimeError, OSError, SafetensorError) as e:
        raise CorpError(f"weights in {path} do not match its {META_FILE}: {first_line(e)}") from None
    return model.to(device).eval()
