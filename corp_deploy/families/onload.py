"""Sequential onloading: a model whose blocks' weights stay on disk until the block-by-block walk needs them.

Why: a 1.7B decoder held in float32 is 6.4 GiB resident for the whole prune, most of the run's peak, while the walk
(``core.blockwise``) only ever works on one block. Here (llm-compressor's idea) the model is built with its
parameters on the meta device; what is not in a block (embeddings, final norm, head: read by every forward's stem)
is read at once, and a block is read from its safetensors files, in float32 as ``from_pretrained(dtype=float32)``
gives it (the same bits), when the walk reaches it. After a block is pruned its new weights go to a temporary
store on disk, and its parameters back to meta, and there they stay: the report measures the pruned model streamed
(``streamed``: one block read at a time), the save writes it one tensor at a time (``tensor``,
``formats.artifact``), and the exports read the saved artifact. ``restore`` reads every block back, for what needs
the model whole (a recovery, a caller's own use); the store is deleted with it, or with the model.

The model is registered here (``of``), so the walk and the API need no new argument: a model without an onloader
is the ordinary, fully resident one. Buffers (rotary frequencies, position ids) are small and always resident.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from corp_deploy.base.errors import CorpError
from corp_deploy.base.memory import gib
from corp_deploy.families.registry import adapter_for

_ONLOADERS: weakref.WeakKeyDictionary[nn.Module, Onloader] = weakref.WeakKeyDictionary()


def of(model: nn.Module) -> Onloader | None:
    """``model``'s onloader, or None when every weight is resident."""
    return _ONLOADERS.get(model)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device (no memory) and their buffers real: buffers
    are computed at construction (rotary frequencies) and often absent from the checkpoint."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _set(module: nn.Module, name: str, value: Tensor) -> None:
    """Replace parameter ``name`` (dotted, under ``module``) by ``value``, keeping its ``requires_grad``."""
    owner, _, leaf = name.rpartition(".")
    owner_module = module.get_submodule(owner) if owner else module
    old = owner_module._parameters[leaf]
    owner_module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)


class Onloader:
    """Reads ``model``'s parameters from the safetensors files of ``folder``: the rest at once, a block on ``load``."""

    def __init__(self, model: nn.Module, folder: str | Path, dtype: torch.dtype = torch.float32) -> None:
        self.model, self.dtype, self.device = model, dtype, torch.device("cpu")
        names = {id(m): n for n, m in model.named_modules()}
        self.blocks = list(adapter_for(model).blocks(model))
        self.prefixes = [names[id(b)] + "." for b in self.blocks]
        self.store: tempfile.TemporaryDirectory | None = None
        self.pruned: dict[int, Path] = {}
        self.tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        """Parameters ``tie_weights`` makes (a decoder's head, the embedding's), absent from the checkpoint."""
        self.files = _key_files(Path(folder))
        self.keys = _checkpoint_names(model, self.tied, self.files)

    def start(self) -> Onloader:
        """Read everything outside the blocks, tie the embeddings where the config ties them, and register."""
        inside = tuple(self.prefixes)
        rest = [n for n, _ in self.model.named_parameters() if not n.startswith(inside) and n not in self.tied]
        for name, tensor in self._read(rest).items():
            _set(self.model, name, tensor)
        self.model.tie_weights()
        if any(p.is_meta for n, p in self.model.named_parameters() if not n.startswith(inside)):
            raise KeyError("a weight outside the blocks was neither read nor tied")
        _ONLOADERS[self.model] = self
        return self

    def _read(self, names: list[str]) -> dict[str, Tensor]:
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[self.keys[n]], []).append(n)
        out = {}
        for path, found in by_file.items():
            with safe_open(str(path), "pt", device="cpu") as f:
                for n in found:
                    out[n] = f.get_tensor(self.keys[n]).to(self.device, self.dtype)
        return out

    def to(self, device: torch.device) -> None:
        """Blocks are read onto ``device`` from now on; what is resident moves there."""
        self.device = device
        moved: dict[int, nn.Parameter] = {}  # by identity: a tied head and its embedding stay one parameter
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and not p.is_meta:
                    if id(p) not in moved:
                        moved[id(p)] = nn.Parameter(p.data.to(device), requires_grad=p.requires_grad)
                    module._parameters[name] = moved[id(p)]
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = b.to(device)

    def load(self, i: int) -> None:
        """Block ``i``'s weights in memory: the dense ones from the checkpoint, or the pruned ones from the store."""
        block = self.blocks[i]
        if i in self.pruned:
            block.load_state_dict(load_file(self.pruned[i], device=str(self.device)), strict=False, assign=True)
            return
        names = [n for n, _ in block.named_parameters()]
        for name, tensor in self._read([self.prefixes[i] + n for n in names]).items():
            _set(block, name.removeprefix(self.prefixes[i]), tensor)

    def tensor(self, name: str) -> Tensor:
        """Parameter ``name`` of a block, as it is now, alone: from the store once its block is pruned, else from the
        checkpoint (what a save reads, one tensor at a time, instead of the blocks whole)."""
        i = next(i for i, prefix in enumerate(self.prefixes) if name.startswith(prefix))
        if i not in self.pruned:
            return self._read([name])[name]
        with safe_open(str(self.pruned[i]), "pt", device="cpu") as f:
            return f.get_tensor(name.removeprefix(self.prefixes[i]))

    def drop(self, i: int, pruned: bool = False) -> None:
        """Block ``i``'s parameters back to meta; ``pruned``: its weights changed, so they are kept in the store."""
        block = self.blocks[i]
        if pruned:
            if self.store is None:
                self.store = tempfile.TemporaryDirectory(prefix="corp-onload-")
            self.pruned[i] = Path(self.store.name, f"block{i}.safetensors")
            try:
                save_file({n: p.detach().contiguous().cpu() for n, p in block.named_parameters()}, self.pruned[i])
            except OSError as e:  # a full disk: one line, the store removed
                self.store.cleanup()
                raise CorpError(
                    f"could not keep pruned block {i} in {self.store.name} ({e.strerror or e}): the pruned blocks "
                    "wait there until the walk ends (about the pruned model's float32 size); free space there or "
                    "point TMPDIR at a disk with room"
                ) from None
        for name, p in list(block.named_parameters()):
            _set(block, name, torch.empty_like(p, device="meta"))

    def resident_bytes(self) -> int:
        """Bytes of the parameters in memory now."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.is_meta)

    def held_bytes(self) -> int:
        """Bytes the onloaded model holds at most (``dtype``): everything outside the blocks and the largest block;
        known from the meta shapes before anything is read."""
        inside = tuple(self.prefixes)
        size = torch.empty((), dtype=self.dtype).element_size()
        rest = sum(
            p.numel() for n, p in self.model.named_parameters() if not n.startswith(inside) and n not in self.tied
        )
        return rest * size + self.block_bytes()

    def block_bytes(self) -> int:
        """Bytes of the largest block's parameters as read (``dtype``)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return max(sum(p.numel() for p in b.parameters()) * size for b in self.blocks)

    @contextlib.contextmanager
    def streamed(self) -> Iterator[None]:
        """Every forward inside reads each block as it runs and drops it after (one block in memory)."""
        handles = []
        for i, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(lambda *_, i=i: self.load(i)))
            handles.append(block.register_forward_hook(lambda *_, i=i: self.drop(i)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def restore(self) -> None:
        """Every block in memory again (pruned ones from the store), the store deleted, the model unregistered."""
        for i, block in enumerate(self.blocks):
            if any(p.is_meta for p in block.parameters()):
                self.load(i)
        self.release()

    def release(self) -> None:
        """The store deleted and the model unregistered, its blocks left on meta: once it is saved, the artifact is
        the pruned model (the store is the pruned model's float32 size on disk, beside what comes next)."""
        if self.store is not None:
            self.store.cleanup()
            self.store = None
        _ONLOADERS.pop(self.model, None)


def streamed(model: nn.Module) -> contextlib.AbstractContextManager:
    """``Onloader.streamed`` for an onloaded model, else nothing."""
    onloader = of(model)
    return contextlib.nullcontext() if onloader is None else onloader.streamed()


def restore(model: nn.Module) -> None:
    """``model`` with every weight resident (a no-op when it is already)."""
    onloader = of(model)
    if onloader is not None:
        onloader.restore()


def release(model: nn.Module) -> None:
    """``Onloader.release`` for an onloaded model, else nothing."""
    onloader = of(model)
    if onloader is not None:
        onloader.release()


def disk_shortfall(model: nn.Module, out: str | Path) -> str | None:
    """The one line to say before the walk when the disks may not take what an onloaded ``model``'s prune writes
    (None when they will, or when nothing is onloaded): its pruned blocks, kept in the store (``TMPDIR``) until the
    save, then the artifact beside them under ``out``, each at most the dense model's float32 size (pruning only
    shrinks them; by how much is known after the walk), both at once where they share a disk. A warning, not a
    refusal: the bound is the dense size, and a full disk later is still one line (``drop``, ``fsio.staged``)."""
    onloader = of(model)
    if onloader is None:
        return None
    size = torch.empty((), dtype=onloader.dtype).element_size()
    store = sum(p.numel() for block in onloader.blocks for p in block.parameters()) * size
    artifact = store + onloader.held_bytes() - onloader.block_bytes()  # the blocks and everything outside them
    tmp, dest = Path(tempfile.gettempdir()), Path(out).absolute()
    while not dest.exists():
        dest = dest.parent
    same = os.stat(tmp).st_dev == os.stat(dest).st_dev
    needs = {tmp: store + artifact} if same else {tmp: store, dest: artifact}
    short = {where: (need, shutil.disk_usage(where).free) for where, need in needs.items()}
    short = {where: (need, free) for where, (need, free) in short.items() if free < need}
    if not short:
        return None
    room = "; ".join(f"{where}: up to {gib(need)} needed, {gib(free)} free" for where, (need, free) in short.items())
    return (
        f"disk: the pruned blocks wait in {tmp} (TMPDIR, up to {gib(store)}) until the artifact is written to "
        f"{dest} (up to {gib(artifact)}): {room}; the prune may run out of disk: free space, set TMPDIR to a disk "
        "with room or choose another --out"
    )


def _checkpoint_names(model: nn.Module, tied: set[str], files: dict[str, Path]) -> dict[str, str]:
    """Parameter name -> its name in the checkpoint: the same, or with the base model's prefix added (a head
    model's checkpoint read into the base model: a config without ``architectures``) or taken away (the reverse),
    as ``from_pretrained`` reads them. KeyError when no way names every parameter."""
    names = [n for n, _ in model.named_parameters() if n not in tied]
    base = getattr(model, "base_model_prefix", "") + "."
    for add, strip in (("", ""), (base, ""), ("", base)):
        keys = {n: add + n.removeprefix(strip) for n in names}
        if all(k in files for k in keys.values()):
            return keys
    raise KeyError(f"not in the checkpoint: {[n for n in names if n not in files][:3]}")


def _key_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of ``folder`` holding it (sharded folders through their index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            files |= dict.fromkeys(f.keys(), path)
    return files
