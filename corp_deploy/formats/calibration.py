"""What calibration reads: images or documents drawn from a folder (or synthetic ones), split into the
batches the statistics sum and the held-out inputs the width planning measures on, sharded per rank; the device
it runs on; and INT8's calibration and verification images (``folder_split``), a prefix of CORP's sample and the
images after it, as arrays a graph takes."""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from corp_deploy.base.errors import CorpError
from corp_deploy.core.distributed import SINGLE_PROCESS, World, shard
from corp_deploy.families import adapter_for
from corp_deploy.formats.data import (
    HELDOUT_SEED_OFFSET,
    SYNTHETIC,
    data_config,
    folder_batches,
    folder_counts,
    input_size,
    list_images,
    sample,
    split,
    synthetic_batches,
)
from corp_deploy.formats.text import (
    check_seq_len,
    packed_batches,
    packed_sequences,
    read_documents,
    shuffled,
    split_documents,
    synthetic_text_batches,
    text_batches,
    tokenize,
)

T = TypeVar("T")


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` is the GPU when there is one; asking for ``cuda`` without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CorpError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu or auto")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise CorpError(f"--device must be auto, cpu or cuda[:N], got {name!r}")
    return torch.device(name)


class Heldout(NamedTuple):
    """Calibration inputs kept out of the statistics for the width planning (the sensitivity pass)."""

    images: Any
    """One batch: images, or a text model's token ids with their attention mask (``{"input_ids", ...}``)."""
    folders: dict[str, int]
    """Where they came from: count per folder (class) of the source, or ``{"synthetic": n}``."""


class Calibration(NamedTuple):
    batches: Iterable[tuple[Tensor, int]]
    total: int
    """Images the batches cover (this rank's shard)."""
    heldout: Heldout | None


def calibration_data(
    model: nn.Module,
    source: str | Path,
    num: int = 4000,
    batch_size: int = 64,
    seed: int = 0,
    workers: int | None = None,
    world: World = SINGLE_PROCESS,
    hold_out: int = 0,
) -> Calibration:
    """Batches of (images, skipped) from a folder, or noise when ``source == "synthetic"``, and ``hold_out`` of the
    ``num`` images kept apart (``data.split``: a seeded draw across the whole sample, the batches keep their order).

    Under torch.distributed each rank gets its own disjoint shard of the same seeded sample (``distributed.shard``);
    every rank makes the same split, and the held-out images are read on rank 0 only (the planning runs there).
    """
    if num < 1 or batch_size < 1:
        raise CorpError("--num-calib and --calib-batch-size must be >= 1")
    if hold_out >= num:
        raise CorpError(
            f"{hold_out} of the {num} calibration images are held out for --allocation sensitivity "
            "(--sensitivity-images); pass more images or lower --sensitivity-images"
        )
    if str(source) == SYNTHETIC:
        warnings.warn(
            "calibrating on NOISE images (source 'synthetic'; the CLI's --calib synthetic): use only for smoke tests, "
            "the pruned model's accuracy is meaningless; calibrate on a folder of real images (--calib-dir).",
            stacklevel=2,
        )
        num -= hold_out
        batches, total = _own_batches(
            synthetic_batches(num, batch_size, input_size(model), seed), num, batch_size, world
        )
        heldout = None
        if hold_out and world.is_main:
            images = next(synthetic_batches(hold_out, hold_out, input_size(model), seed + HELDOUT_SEED_OFFSET))[0]
            heldout = Heldout(images, {SYNTHETIC: hold_out})
        return Calibration(batches, total, heldout)
    root = Path(source)
    found = list_images(root)
    short(source, len(found), num, "images")
    files, held = split(sample(found, num, seed), hold_out, seed)
    files = shard(files, world)
    workers = min(8, os.cpu_count() or 1) if workers is None else workers
    heldout = None
    if held and world.is_main:
        loaded = [images for images, _ in folder_batches(held, data_config(model), len(held), 0)]
        if not loaded or sum(x.shape[0] for x in loaded) == 0:
            raise CorpError(f"none of the {len(held)} held-out calibration images could be read; check the files")
        heldout = Heldout(torch.cat(loaded), folder_counts(held, root))
    return Calibration(folder_batches(files, data_config(model), batch_size, workers), len(files), heldout)


def short(source: str | Path, found: int, asked: int, what: str) -> None:
    """A warning when ``source`` holds fewer calibration items than asked for: the pass uses what there is, and the
    report's count (and its errors, fit on less data) would otherwise read as what was asked."""
    if found < asked:
        warnings.warn(f"{source} holds {found} {what}, not the {asked} asked for: calibrating on {found}", stacklevel=3)


def _own_batches(batches: Iterable[T], num: int, batch_size: int, world: World) -> tuple[Iterable[T], int]:
    """This rank's whole batches of a seeded synthetic stream of ``num`` items (every rank draws the same
    stream), and how many items they hold."""
    sizes = [min(batch_size, num - start) for start in range(0, num, batch_size)]
    return (b for i, b in enumerate(batches) if i % world.size == world.rank), sum(shard(sizes, world))


def text_calibration_data(
    model: nn.Module,
    tokenizer: Any,
    source: str | Path,
    num: int = 256,
    batch_size: int = 16,
    seed: int = 0,
    seq_len: int = 128,
    hold_out: int = 0,
    world: World = SINGLE_PROCESS,
) -> Calibration:
    """``calibration_data`` for a text model: ``num`` sequences of the calibration documents of a folder of
    .txt/.jsonl files (``text.split_documents``), or random token ids when ``source == "synthetic"``.

    The model decides the form: a decoder (``Adapter.causal``) gets the seeded documents packed into ``num``
    full ``seq_len`` windows (every token counts); an encoder a seeded sample of ``num`` documents, one per
    sequence, padded and masked. ``hold_out`` sequences for the sensitivity pass come, in the same form, from the
    split's held-out documents (disjoint from calibration and evaluation), as one batch. Under torch.distributed
    each rank gets its own disjoint shard of the same seeded sample (documents, packed windows, or whole batches
    of random tokens), as ``calibration_data`` shards images."""
    if num < 1 or batch_size < 1:
        raise CorpError("--num-calib and --calib-batch-size must be >= 1")
    check_seq_len(seq_len, model.config)
    heldout = None
    if str(source) == SYNTHETIC:
        warnings.warn(
            "calibrating on RANDOM TOKENS (source 'synthetic'; the CLI's --calib synthetic): use only for smoke "
            "tests; calibrate on a folder of text (--calib-dir).",
            stacklevel=2,
        )
        vocab = model.config.vocab_size
        if hold_out and world.is_main:
            held = next(synthetic_text_batches(vocab, hold_out, seq_len, hold_out, seed + HELDOUT_SEED_OFFSET))[0]
            heldout = Heldout(held, {SYNTHETIC: hold_out})
        tokens = synthetic_text_batches(vocab, num, seq_len, batch_size, seed)
        return Calibration(*_own_batches(tokens, num, batch_size, world), heldout)
    if tokenizer is None:
        raise CorpError(f"{source}: text calibration needs the model's tokenizer, and its folder has none")
    parts = split_documents(read_documents(source))
    if hold_out and not parts.heldout:
        raise CorpError(
            f"{source} has too few documents to hold any out for --allocation sensitivity (a tenth of them is "
            "kept for it); pass more documents or use --allocation local"
        )
    causal = adapter_for(model).causal
    if hold_out and world.is_main:
        if causal:
            held_ids = packed_sequences(tokenizer, shuffled(parts.heldout, seed), seq_len, hold_out, "held-out")
            heldout = Heldout(next(packed_batches(held_ids, hold_out))[0], {"held-out documents": held_ids.shape[0]})
        else:
            held_docs = sample(parts.heldout, hold_out, seed)
            heldout = Heldout(
                tokenize(tokenizer, [d.text for d in held_docs], seq_len), dict(Counter(d.folder for d in held_docs))
            )
    if causal:
        ids = packed_sequences(tokenizer, shuffled(parts.calibration, seed), seq_len, num)
        short(source, ids.shape[0], num, f"calibration sequences of {seq_len} tokens")
        mine = ids[world.rank :: world.size]  # this rank's shard of the packed windows (``distributed.shard``)
        return Calibration(packed_batches(mine, batch_size), mine.shape[0], heldout)
    short(source, len(parts.calibration), num, "calibration documents")
    docs = shard(sample(parts.calibration, num, seed), world)
    return Calibration(text_batches(tokenizer, docs, seq_len, batch_size), len(docs), heldout)


def calibration_batches(
    model: nn.Module,
    source: str | Path,
    num: int = 4000,
    batch_size: int = 64,
    seed: int = 0,
    workers: int | None = None,
    world: World = SINGLE_PROCESS,
) -> tuple[Iterable[tuple[Tensor, int]], int]:
    """``calibration_data`` without a held-out set: (batches, images they cover)."""
    data = calibration_data(model, source, num, batch_size, seed, workers, world)
    return data.batches, data.total


def calibration_windows(
    tokenizer: Any, source: str | Path, vocab: int, seq_len: int, num: int, seed: int = 0
) -> Tensor:
    """(``num``, ``seq_len``) token ids a calibrated quantizer (GPTQ) reads: packed windows of a text folder's
    calibration documents (``text.split_documents``: never the held-out documents its gate scores, nor evaluation
    text), or random tokens below ``vocab`` for ``source == "synthetic"``, drawn apart from ``heldout_windows``'."""
    if num < 1 or seq_len < 2:
        raise CorpError(f"calibration needs >= 1 window of >= 2 tokens, got {num} x {seq_len}")
    if str(source) == SYNTHETIC:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (num, seq_len), generator=g)
    if tokenizer is None:
        raise CorpError(f"{source}: decoder calibration needs the model's tokenizer, and its folder has none")
    parts = split_documents(read_documents(source))
    return packed_sequences(tokenizer, shuffled(parts.calibration, seed), seq_len, num, "calibration")


ImageSplit = tuple[list[np.ndarray], list[np.ndarray], dict[str, dict[str, int]]]
"""INT8's (calibration, held-out) NCHW float32 batches and how many of each came from every folder."""


def split_images(files: Sequence[Path], num_calib: int, num_verify: int, seed: int) -> tuple[list[Path], list[Path]]:
    """(calibration, held-out) files: prefixes of one seeded permutation, as ``data.sample`` draws them.

    With fewer files than asked, a quarter (at least one) is held out so verification never sees a
    calibration image.
    """
    if num_calib < 1 or num_verify < 1:
        raise CorpError("--num-calib and --num-verify must be >= 1")
    if len(files) < 2:
        raise CorpError(f"INT8 needs at least 2 images (calibration and held-out verification), found {len(files)}")
    held = min(num_verify, max(1, len(files) // 4))
    calib_num = min(num_calib, len(files) - held)
    calib = sample(files, calib_num, seed)
    taken = set(calib)
    return calib, [f for f in sample(files, calib_num + held, seed) if f not in taken]


def image_arrays(files: list[Path], config: dict[str, Any], batch_size: int = 32, workers: int = 0) -> list[np.ndarray]:
    """Preprocessed images as NCHW float32 arrays (unreadable files skipped), held in memory: read once."""
    batches = [x.numpy() for x, _ in folder_batches(files, config, batch_size, workers) if len(x)]
    if not batches:
        raise CorpError(f"none of the {len(files)} images could be read; check the image folder")
    return batches


def noise_arrays(num: int, size: Sequence[int], seed: int, batch_size: int = 32) -> list[np.ndarray]:
    """Noise for smoke runs (``--calib synthetic``): exercises quantization, says nothing about accuracy."""
    return [x.numpy() for x, _ in synthetic_batches(num, batch_size, tuple(size), seed)]


def folder_split(
    folder: str | Path, config: dict[str, Any], num_calib: int, num_verify: int, seed: int, workers: int = 0
) -> ImageSplit:
    """(calibration, held-out) image batches from ``folder``, preprocessed as ``config`` (timm's data config, as a
    graph's metadata records it) says, and how many of each came from every subfolder (class): the record shows both
    are drawn across the classes."""
    calib, held = split_images(list_images(folder), num_calib, num_verify, seed)
    folders = {"calibration": folder_counts(calib, folder), "verification": folder_counts(held, folder)}
    return image_arrays(calib, config, workers=workers), image_arrays(held, config, workers=workers), folders


def noise_split(size: Sequence[int], num_calib: int, num_verify: int, seed: int) -> ImageSplit:
    """``folder_split`` for ``--calib synthetic``: noise of the graph's input ``size``, held-out drawn with
    ``seed + 1``."""
    folders = {"calibration": {SYNTHETIC: num_calib}, "verification": {SYNTHETIC: num_verify}}
    return noise_arrays(num_calib, size, seed), noise_arrays(num_verify, size, seed + 1), folders
