"""A safetensors file written one tensor at a time: the header from shapes alone, each tensor read only when its
bytes are written.

Why: ``safetensors.torch.save_model`` needs every tensor in memory at once. An onloaded prune (``families.onload``)
keeps its pruned blocks on disk, and reading them all back to save them made the save, not the walk, the run's
peak (the 1.7B shape: 7.26 GiB at the save against 5.07 in the walk). Here the header is written from the tensors'
shapes and dtypes (meta tensors will do) and ``read`` is asked for each tensor in file order, so the file is written
holding one tensor beside what the caller holds anyway.

The layout is safetensors' own (its ``serialize``, version 0.8): tensors ordered by dtype as its ``Dtype`` enum
orders them, widest first, then by name; the header compact JSON padded with spaces to 8 bytes. A file written here
has the same bytes as ``save_file``'s, but for ``__metadata__``, which safetensors writes from a hash map in an order
that changes from run to run and which is written here sorted by key (tested against ``save_file``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
"""torch dtype -> safetensors' name, in the order of safetensors' ``Dtype`` enum (the file puts the last first)."""
RANK = {dtype: rank for rank, dtype in enumerate(DTYPES)}


def write(
    path: str | Path,
    tensors: Mapping[str, Tensor],
    read: Callable[[str, Tensor], Tensor],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` (name -> a tensor of the right shape and dtype, on any device, meta included) to ``path``,
    the bytes of each from ``read(name, tensor)``, called once per tensor in file order."""
    order = sorted(tensors, key=lambda name: (-RANK[tensors[name].dtype], name))
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in order:
            t = read(name, tensors[name]).detach().contiguous().cpu()
            if t.shape != tensors[name].shape or t.dtype != tensors[name].dtype:
                raise ValueError(
                    f"{name}: read {t.dtype} {tuple(t.shape)}, the header says {tensors[name].dtype} "
                    f"{tuple(tensors[name].shape)}"
                )
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
