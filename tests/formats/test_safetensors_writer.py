"""The safetensors file written one tensor at a time (``formats.safetensors_writer``): the header from meta tensors,
each tensor read once when its bytes are written, the bytes ``safetensors.torch.save_file`` writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from corp_deploy.formats import safetensors_writer

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.bool, torch.int8, torch.uint8, torch.float64]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.w": (torch.randn(i + 1, 3, generator=g) * 9).to(d) for i, d in enumerate(DTYPES)}
    return tensors | {"empty": torch.zeros(0), "a.scalar": torch.tensor(2.5)}


@pytest.mark.parametrize("metadata", [None, {"format": "corp-deploy/pruned"}])
def test_the_file_has_save_files_bytes_and_each_tensor_is_read_once_in_file_order(metadata, tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "theirs.safetensors", metadata=metadata)
    asked: list[str] = []

    def read(name: str, meta: torch.Tensor) -> torch.Tensor:
        assert meta.is_meta
        asked.append(name)
        return tensors[name]

    shapes = {name: t.to("meta") for name, t in tensors.items()}
    safetensors_writer.write(tmp_path / "ours.safetensors", shapes, read, metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    assert sorted(asked) == sorted(tensors) and asked[0] == "layer.2.w"  # int64 first, as safetensors orders them
    loaded = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_a_tensor_read_unlike_its_header_fails(tmp_path: Path) -> None:
    shapes = {"w": torch.empty(2, 3, device="meta")}
    with pytest.raises(ValueError, match=r"w: read torch.float32 \(3, 2\)"):
        safetensors_writer.write(tmp_path / "x.safetensors", shapes, lambda *_: torch.zeros(3, 2))
