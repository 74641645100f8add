"""Real photos offline: calibration and held-out crops from scikit-image's bundled sample images.

    python -m bench.skimage_photos runs/photos      # -> runs/photos/{calib,heldout}/*.jpg

The sample photos are split by SOURCE image (12 for calibration, the rest held out, seeded), so
no held-out crop shares a photo with calibration. Needs ``pip install scikit-image``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

SAMPLES = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "cat",
    "immunohistochemistry",
    "retina",
    "colorwheel",
    "logo",
    "hubble_deep_field",
    "page",
    "camera",
    "moon",
    "coins",
    "text",
    "clock",
    "brick",
    "grass",
    "gravel",
)


def load(name: str) -> Image.Image:
    import skimage.data

    a = getattr(skimage.data, name)()
    a = a[..., :3] if a.ndim == 3 else a
    if a.dtype != np.uint8:
        a = (255 * (a - a.min()) / (np.ptp(a) + 1e-9)).astype(np.uint8)
    return Image.fromarray(a).convert("RGB")


def write_crops(photos: list[Image.Image], n: int, out: Path, rng: np.random.Generator) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        im = photos[k % len(photos)]
        w, h = im.size
        s = rng.uniform(0.3, 1.0)
        cw, ch = int(w * s), int(h * s)
        x0, y0 = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
        crop = im.crop((x0, y0, x0 + cw, y0 + ch)).resize((256, 256))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        crop.save(out / f"{k:04d}.jpg", quality=92)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--calib", type=int, default=192)
    p.add_argument("--heldout", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    order = rng.permutation(len(SAMPLES))
    photos = [load(SAMPLES[i]) for i in order]
    write_crops(photos[:12], a.calib, a.out / "calib", rng)
    write_crops(photos[12:], a.heldout, a.out / "heldout", rng)
    print(f"wrote {a.calib} calibration and {a.heldout} held-out crops under {a.out}")


if __name__ == "__main__":
    main()
