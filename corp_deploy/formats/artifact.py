"""The prune artifact: ``model.safetensors`` + ``corp.json``, written atomically, reloadable alone.

``corp.json`` records the model family, its name and arguments and the per-block structure, which is
everything needed to rebuild the module tree; the weights then load strictly. No calibration data, no
surgery replay.

Extending the format without a version bump: a family is a name in the registry (``families.get``: how to build
the dense tree and apply the structure), and each block's entry is a dict whose keys the family declares. A reader
refuses a family or a block key it does not know ("upgrade corp-deploy") instead of silently building
another model, so a new kind of entry (a removed module, another family's widths) needs no new version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import _remove_duplicate_names, load_file
from torch import Tensor, nn

from corp_deploy import families
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.fsio import atomic_dir
from corp_deploy.families import onload
from corp_deploy.formats import safetensors_writer

FORMAT = "corp-deploy/pruned"
READS = frozenset({FORMAT, "corp-deploy/pruned-vit"})
"""Format names this version reads: artifacts of every family were written as ``pruned-vit`` before text models."""
FORMAT_VERSION = 3
"""3: a ``family`` and unknown block keys refused; 2: each block's ``v_dim``; 1 (V never pruned). All load."""
DEFAULT_FAMILY = "timm-vit"
"""The family of artifacts written before families were recorded (every one of them is a timm ViT)."""
WEIGHTS_FILE = "model.safetensors"
META_FILE = "corp.json"


def save_pruned(model: nn.Module, out: str | Path, meta: dict[str, Any], overwrite: bool = False) -> Path:
    """Write ``model`` and its description to ``out`` atomically.

    ``meta`` must hold ``model: {name, args}``; the per-block widths are taken from the model itself. The weights
    are written one tensor at a time (``write_weights``): an onloaded model's pruned blocks are read from their
    store as they are written, never the whole model at once.
    """
    adapter, loader = families.adapter_for(model), onload.of(model)
    model = adapter.stored(model)  # a copy where the family adds zero biases: the loader is the model's
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "family": adapter.name,
        **meta,
        "structure": families.structure(model),
    }
    try:
        with atomic_dir(out, overwrite) as tmp:
            write_weights(model, tmp / WEIGHTS_FILE, loader)
            folder = adapter.write_files(model, tmp)
            (tmp / META_FILE).write_text(json.dumps(record | ({"folder": folder} if folder else {}), indent=2) + "\n")
    except OSError as e:  # a full disk is already one line (``fsio.staged``)
        raise CorpError(f"could not write {out} ({first_line(e)}); whatever was there is unchanged") from None
    return Path(out)


def write_weights(model: nn.Module, path: Path, loader: onload.Onloader | None = None) -> None:
    """``model``'s state as ``safetensors.torch.save_model`` writes it (tied weights stored once under the first
    name, the others recorded in the metadata; the same bytes: ``formats.safetensors_writer``), each tensor read
    when it is written: a weight still on disk (on the meta device: an onloaded model's pruned blocks) from
    ``loader`` (``families.onload``), one tensor at a time."""
    state = model.state_dict()
    metadata = {"format": FORMAT}
    for kept, removed in _remove_duplicate_names(state).items():  # safetensors' own choice of the name kept
        for name in removed:
            metadata.setdefault(name, kept)
            del state[name]

    def read(name: str, tensor: Tensor) -> Tensor:
        return loader.tensor(name) if tensor.is_meta and loader is not None else tensor

    safetensors_writer.write(path, state, read, metadata)


def read_meta(path: str | Path) -> dict[str, Any]:
    """``corp.json`` of an artifact folder, checked to be one this version can load."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise CorpError(f"{path} is not a corp-deploy prune artifact (no {META_FILE}); run `corp-deploy prune` first")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CorpError(f"{meta_path} is corrupt ({e}); re-run `corp-deploy prune`") from None
    if not isinstance(meta, dict) or meta.get("format") not in READS or meta.get("format_version", 0) > FORMAT_VERSION:
        raise CorpError(f"{meta_path} is not a prune artifact this corp-deploy version reads; upgrade or re-prune")
    model = meta.get("model")
    if not (
        isinstance(model, dict)
        and isinstance(model.get("name"), str)
        and isinstance(model.get("args", {}), dict)
        and isinstance(meta.get("structure"), list)
    ):
        raise CorpError(f"{meta_path} lacks the model name, arguments or structure; re-run `corp-deploy prune`")
    family = families.get(meta.setdefault("family", DEFAULT_FAMILY))
    if family is None:
        raise CorpError(f"{meta_path} is a {meta['family']!r} model, which this corp-deploy cannot build; upgrade it")
    unknown = sorted({k for b in meta["structure"] if isinstance(b, dict) for k in b} - family.block_keys)
    if unknown:
        raise CorpError(
            f"{meta_path} records block entries this corp-deploy does not know ({', '.join(unknown)}); upgrade it"
        )
    return meta


def build(meta: dict[str, Any], folder: Path) -> nn.Module:
    """The DENSE module tree an artifact's ``corp.json`` (``read_meta``) describes, weights unfilled."""
    return families.get(meta["family"]).build(meta, folder)


def load_pruned(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a pruned model (eval mode) from an artifact folder, without calibration data.

    The dense tree is built with its parameters on the meta device (``onload.meta_parameters``) and the structure
    applied there, then the saved tensors become the parameters (``assign``): only the pruned weights are ever
    allocated. Building the dense tree for real first held it beside the pruned weights (the 1.7B shape: 6.4 GiB
    of random initialisation, then 5.0 GiB read, 10.7 GiB peak)."""
    meta = read_meta(path)
    try:
        with onload.meta_parameters():
            model = build(meta, Path(path))
            families.get(meta["family"]).apply_structure(model, meta["structure"])
    except (RuntimeError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise CorpError(
            f"{Path(path) / META_FILE} describes a model this corp-deploy cannot build ({first_line(e)}); "
            "re-run `corp-deploy prune`"
        ) from None
    try:
        _assign(model, Path(path) / WEIGHTS_FILE)
    except (RuntimeError, OSError, SafetensorError) as e:
        raise CorpError(f"weights in {path} do not match its {META_FILE}: {first_line(e)}") from None
    return model.to(device).eval()


def _assign(model: nn.Module, path: Path) -> None:
    """The file's tensors as ``model``'s parameters and buffers, strictly: every parameter filled, no tensor left
    over. A tensor saved once under several names (an LM head tied to the embedding; the file's metadata maps each
    name left out to the one kept, as ``safetensors.torch.save_model`` records it) becomes one parameter again."""
    with safe_open(str(path), "pt", device="cpu") as f:
        links = {name: kept for name, kept in (f.metadata() or {}).items() if name != "format"}
    state = load_file(str(path))
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if extra := sorted(set(state) - params - {name for name, _ in model.named_buffers()}):
        raise RuntimeError(f"unexpected tensors {', '.join(extra[:3])}")
    if missing := sorted(params - set(state) - set(links)):
        raise RuntimeError(f"missing tensors {', '.join(missing[:3])}")
    model.load_state_dict(state, strict=False, assign=True)
    for name, kept in links.items():
        if name in params:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(kept))
