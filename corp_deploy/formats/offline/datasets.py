"""Real labelled images offline, written as ImageFolder trees that ``corp-deploy eval`` reads.

Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` (IDX files), the digits from
scikit-learn (bundled with it). Both are small grey images: the model's own eval transform
upsamples them, exactly as it would any other image, so nothing here is model-specific.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_dir, cache_dir

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = ("tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")


def read_idx(path: Path) -> np.ndarray:
    """An IDX array (the MNIST format: magic, dims, then raw big-endian data), gzipped or not."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] != 0x08:
        raise CorpError(f"{path} is not an unsigned-byte IDX file")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise CorpError(f"{path} is truncated: {data.size} bytes for shape {shape}")
    return data.reshape(shape)


def fashion_mnist(root: Path = FASHION_MNIST) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels) as uint8 arrays."""
    if not (root / "train-images-idx3-ubyte.gz").is_file():
        raise CorpError(
            f"Fashion-MNIST is not in {root}: `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu), "
            "or use --dataset digits"
        )
    load = lambda stem: read_idx(root / f"{stem}-ubyte.gz")  # noqa: E731
    return load("train-images-idx3"), load("train-labels-idx1"), load("t10k-images-idx3"), load("t10k-labels-idx1")


def digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's 1797 8x8 digits, split 2:1 by a seeded permutation, scaled to uint8."""
    d = require("sklearn.datasets", "the digits dataset").load_digits()
    images = (d.images * (255 / 16)).round().astype(np.uint8)
    order = np.random.default_rng(seed).permutation(len(images))
    cut = 2 * len(images) // 3
    train, test = order[:cut], order[cut:]
    return images[train], d.target[train], images[test], d.target[test]


DATASETS: dict[str, tuple[Callable[[], tuple], tuple[str, ...]]] = {
    "fashion-mnist": (fashion_mnist, FASHION_CLASSES),
    "digits": (digits, tuple(str(i) for i in range(10))),
}


def resolve(name: str) -> str:
    """``auto`` is Fashion-MNIST where the Debian package is installed (photos of objects, harder), else the digits."""
    if name == "auto":
        return "fashion-mnist" if (FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file() else "digits"
    if name not in DATASETS:
        raise CorpError(f"unknown dataset {name!r}; choose auto or one of {', '.join(DATASETS)}")
    return name


def balanced(labels: np.ndarray, num: int, seed: int) -> np.ndarray:
    """Indices of ``num`` samples, as equal per class as possible, seeded, in a fixed order."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    per = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    picks = [p[k] for k in range(max(map(len, per))) for p in per if k < len(p)][:num]
    return np.sort(np.array(picks, dtype=np.int64))


def write_image_folder(images: np.ndarray, labels: np.ndarray, classes: tuple[str, ...], out: Path) -> None:
    """``out/<class>/<index>.png`` for every image."""
    for name in classes:
        (out / name).mkdir(parents=True, exist_ok=True)
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        Image.fromarray(image).save(out / classes[int(label)] / f"{i:05d}.png")


def image_folders(name: str, train: int, test: int, seed: int = 0, root: Path | None = None) -> tuple[Path, Path]:
    """Balanced train and test ImageFolder trees of dataset ``name``, written once and cached."""
    name = resolve(name)
    if train < 10 or test < 10:
        raise CorpError("the train and test sets need at least 10 images each")
    out = (root or cache_dir() / "data") / f"{name}-train{train}-test{test}-seed{seed}"
    if not out.is_dir():
        load, classes = DATASETS[name]
        x_train, y_train, x_test, y_test = load()
        with atomic_dir(out, overwrite=True) as tmp:
            for split, x, y, n in (("train", x_train, y_train, train), ("test", x_test, y_test, test)):
                pick = balanced(y, n, seed)
                write_image_folder(x[pick], y[pick], classes, tmp / split)
    return out / "train", out / "test"
