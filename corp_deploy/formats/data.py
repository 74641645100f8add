"""Images in, as a model takes them: its input size and preprocessing, folders of images (or noise).

The input format beside the artifact format: calibration (CORP and INT8) and evaluation read
images through here, so ``exporters`` and ``bench`` use it without the pruning core.

Batches are ``(images, skipped)`` pairs: unreadable files are dropped from the batch and counted,
so one corrupt JPEG in 4000 costs one image, not the run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from PIL import Image
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from corp_deploy.base.errors import CorpError
from corp_deploy.families import adapter_for

T = TypeVar("T")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
SYNTHETIC = "synthetic"
"""The image source that means noise (``--calib synthetic``): for smoke runs only."""
HELDOUT_SEED_OFFSET = 1
"""Held-out draws use ``seed + 1``, so they do not repeat the sample's own permutation (drawn with ``seed``)."""


def input_size(model: nn.Module) -> tuple[int, int, int]:
    """(C, H, W) the instantiated model expects, as its family reads it (``Adapter.input_size``); a
    ``torch.compile`` wrapper answers for the model it wraps."""
    model = getattr(model, "_orig_mod", model)
    return adapter_for(model).input_size(model)


def data_config(model: nn.Module) -> dict[str, Any]:
    """The model's eval preprocessing in timm's terms (``Adapter.data_config``): what ``folder_batches`` applies."""
    model = getattr(model, "_orig_mod", model)
    return adapter_for(model).data_config(model)


def list_images(root: str | Path) -> list[Path]:
    """Image files under ``root`` (an ImageFolder tree or a flat folder), recursive, sorted."""
    root = Path(root)
    if not root.is_dir():
        raise CorpError(f"image folder {root} does not exist or is not a folder")
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise CorpError(
            f"no images ({', '.join(IMAGE_SUFFIXES)}) under {root} or its subfolders; point it at a folder of images"
        )
    return files


def sample(files: Sequence[T], num: int, seed: int) -> list[T]:
    """A seeded random subset of ``num`` items (all of them if there are fewer), in their original order."""
    if num >= len(files):
        return list(files)
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(files), generator=g)[:num].sort().values
    return [files[i] for i in pick.tolist()]


def split(items: Sequence[T], n: int, seed: int) -> tuple[list[T], list[T]]:
    """(the rest, in their original order; ``n`` items drawn by a seeded permutation of ALL of them).

    A held-out set (the sensitivity pass's images, INT8's verification images) must be drawn across the
    whole sample: the sample keeps its files in path order, so its first ``n`` would come from the first
    class folders of an ImageFolder tree. The rest keep their order, so calibration reads as before.
    """
    g = torch.Generator().manual_seed(seed + HELDOUT_SEED_OFFSET)
    held = set(torch.randperm(len(items), generator=g)[:n].tolist())
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def folder_counts(files: Sequence[Path], root: str | Path) -> dict[str, int]:
    """How many of ``files`` lie in each folder under ``root`` (the class of an ImageFolder tree; ``.`` when flat)."""
    counts: dict[str, int] = {}
    for f in files:
        parent = f.parent.relative_to(root).as_posix() if f.is_relative_to(root) else f.parent.as_posix()
        counts[parent] = counts.get(parent, 0) + 1
    return dict(sorted(counts.items()))


class ImageFiles(Dataset):
    """Decoded, preprocessed images; ``None`` for a file PIL cannot read."""

    def __init__(self, files: list[Path], transform: Any) -> None:
        self.files, self.transform = files, transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Tensor | None:
        try:
            with Image.open(self.files[i]) as im:
                return self.transform(im.convert("RGB"))
        except Exception:  # truncated, corrupt or mislabelled files are skipped and counted
            return None


def _collate(items: list[Tensor | None]) -> tuple[Tensor, int]:
    good = [t for t in items if t is not None]
    skipped = len(items) - len(good)
    if not good:
        return torch.empty(0), skipped
    return torch.stack(good), skipped


def eval_transform(data_config: dict[str, Any]) -> Any:
    """timm's eval preprocessing for ``data_config`` (imported here: only image models pay for timm)."""
    import timm.data

    return timm.data.create_transform(**data_config, is_training=False)


def folder_batches(files: list[Path], data_config: dict[str, Any], batch_size: int, workers: int) -> DataLoader:
    """Batches of (images, skipped) preprocessed with the model's own timm eval transform."""
    return DataLoader(
        ImageFiles(files, eval_transform(data_config)),
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        collate_fn=_collate,
        pin_memory=torch.cuda.is_available(),
    )


def image_folder(root: str | Path) -> tuple[list[Path], list[int], list[str]]:
    """A labelled ImageFolder tree (one subfolder per class): files, class indices, class names.

    Classes are the sorted subfolder names, as in torchvision's ImageFolder, so ImageNet's synset
    folders map to the standard class indices.
    """
    root = Path(root)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not classes:
        raise CorpError(f"{root} is not an ImageFolder tree (one subfolder of images per class)")
    files, labels = [], []
    for index, name in enumerate(classes):
        found = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        files += found
        labels += [index] * len(found)
    if not files:
        raise CorpError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in the class folders of {root}")
    return files, labels, classes


class LabelledFiles(ImageFiles):
    """``ImageFiles`` that also yields each file's label."""

    def __init__(self, files: list[Path], labels: list[int], transform: Any) -> None:
        super().__init__(files, transform)
        self.labels = labels

    def __getitem__(self, i: int) -> tuple[Tensor | None, int]:  # type: ignore[override]
        return super().__getitem__(i), self.labels[i]


def _collate_labelled(items: list[tuple[Tensor | None, int]]) -> tuple[Tensor, Tensor, int]:
    images, skipped = _collate([t for t, _ in items])
    return images, torch.tensor([y for t, y in items if t is not None], dtype=torch.long), skipped


def labelled_batches(
    files: list[Path], labels: list[int], data_config: dict[str, Any], batch_size: int, workers: int
) -> DataLoader:
    """Batches of (images, labels, skipped), preprocessed exactly as calibration images are."""
    return DataLoader(
        LabelledFiles(files, labels, eval_transform(data_config)),
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        collate_fn=_collate_labelled,
    )


def synthetic_batches(num: int, batch_size: int, size: tuple[int, int, int], seed: int) -> Iterator[tuple[Tensor, int]]:
    """Standard-normal noise images: exercises the whole pipeline, says nothing about accuracy."""
    g = torch.Generator().manual_seed(seed)
    for start in range(0, num, batch_size):
        yield torch.randn(min(batch_size, num - start), *size, generator=g), 0
