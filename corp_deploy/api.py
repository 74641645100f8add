"""The Python API: everything the CLI does, callable directly.

model = corp_deploy.create_model("deit_small", weights="random")
batches, total = corp_deploy.calibration_batches(model, "photos/", num=256)
result = corp_deploy.prune(model, batches, corp_deploy.PruneConfig(sparsity=0.5), total=total)
corp_deploy.save(result, "runs/deit_small-s50")
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy import blockwise
from corp_deploy.allocation import check_budget, plan_budget
from corp_deploy.artifact import META_FILE, load_pruned, read_meta, save_pruned
from corp_deploy.data import SYNTHETIC, data_config, folder_batches, input_size, list_images, sample, synthetic_batches
from corp_deploy.distributed import SINGLE_PROCESS, World, all_reduce_stats, shard
from corp_deploy.env import device_name, versions
from corp_deploy.errors import CorpError
from corp_deploy.models import create_model, resolve_name
from corp_deploy.pruner import PruneConfig, Timer, calibrate, plan_widths, prune_model
from corp_deploy.report import model_size, peak_memory
from corp_deploy.sensitivity import measure, split_heldout
from corp_deploy.surgery import block_widths
from corp_deploy.version import __version__


@dataclass
class PruneResult:
    """The pruned model (in place of the dense one) and the report that goes into ``corp.json``."""

    model: nn.Module
    report: dict[str, Any]


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` is the GPU when there is one; asking for ``cuda`` without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CorpError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu or auto")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise CorpError(f"--device must be auto, cpu or cuda[:N], got {name!r}")
    return torch.device(name)


def calibration_batches(
    model: nn.Module,
    source: str | Path,
    num: int = 4000,
    batch_size: int = 64,
    seed: int = 0,
    workers: int | None = None,
    world: World = SINGLE_PROCESS,
) -> tuple[Iterable[tuple[Tensor, int]], int]:
    """Batches of (images, skipped) from a folder, or noise when ``source == "synthetic"``.

    Returns the batches and the number of images they will cover. Under torch.distributed each rank
    gets its own disjoint shard of the same seeded sample (``distributed.shard``).
    """
    if num < 1 or batch_size < 1:
        raise CorpError("--num-calib and --calib-batch-size must be >= 1")
    if str(source) == SYNTHETIC:
        warnings.warn(
            "--calib synthetic: calibrating on NOISE images. Use only for smoke tests; the pruned "
            "model's accuracy is meaningless. Pass --calib-dir with real images for real use.",
            stacklevel=2,
        )
        noise = synthetic_batches(num, batch_size, input_size(model), seed)  # whole batches per rank
        sizes = [min(batch_size, num - start) for start in range(0, num, batch_size)]
        return (b for i, b in enumerate(noise) if i % world.size == world.rank), sum(shard(sizes, world))
    files = shard(sample(list_images(source), num, seed), world)
    workers = min(8, os.cpu_count() or 1) if workers is None else workers
    return folder_batches(files, data_config(model), batch_size, workers), len(files)


def prune(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, int]],
    config: PruneConfig | None = None,
    device: str | torch.device = "auto",
    total: int | None = None,
    progress: bool = True,
    world: World = SINGLE_PROCESS,
    dist_timeout: float = 1800.0,
    max_stats_gib: float | None = None,
) -> PruneResult | None:
    """Calibrate ``model`` once, then prune and compensate it in place; measure what changed.

    Data-parallel (``world.size > 1``, batches from this rank's shard): the statistics are summed
    over all ranks, then rank 0 prunes and gets the result; the other ranks get ``None``.

    With ``config.budget`` and ``allocation="sensitivity"``, the first ``config.sensitivity_images``
    images of ``batches`` (of rank 0's shard) are held out of the statistics and used for the
    sensitivity pass (``sensitivity.measure``), which runs on rank 0 after the statistics are merged.
    ``max_stats_gib`` (bounded memory) or ``config.sequential`` calibrate block by block (``blockwise``);
    a budget with ``sequential`` takes two passes over the (then materialised) batches: the dense
    statistics choose the widths, the sequential walk prunes to them.
    """
    config = config or PruneConfig()
    device = resolve_device(device) if isinstance(device, str) else device
    walked = config.sequential or max_stats_gib is not None
    if config.budget is not None and max_stats_gib is not None:
        raise CorpError("--budget compares every block's statistics at once; drop --max-stats-gib or --budget")
    if config.budget is not None and config.sequential and world.size > 1:
        raise CorpError("--budget with --sequential runs in one process; drop torchrun or one of the two")
    dense = model_size(model)
    if config.budget is None:
        plan_widths(model, config)  # an impossible sparsity fails here, not after calibration
    else:
        check_budget(model, config, dense["macs"])
    if walked:  # an unsupported model or a bound below one block fails here too
        blockwise.check_supported(model)
        blockwise.plan_groups(model, config, max_stats_gib)
    heldout = None
    if config.budget is not None and config.allocation == "sensitivity" and world.is_main:
        heldout, batches, total = _hold_out(batches, config.sensitivity_images, total)
    model.to(device).eval()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = Timer()
    start = time.perf_counter()
    merge = None if world.size == 1 else lambda st: all_reduce_stats(st, world, dist_timeout)
    stats = plan = allocation = None
    if config.budget is not None:
        if config.sequential:
            batches = list(batches)
        stats = calibrate(model, batches, config, device, total=total, progress=progress, merge=merge)
        start = timer.add("calibration", start)
        if world.is_main:
            weights = None if heldout is None else measure(model, stats, config, heldout)
            plan, allocation = plan_budget(model, stats, config, dense["macs"], weights)
            if heldout is not None:
                allocation["heldout_images"] = heldout.shape[0]
            timer.add("allocation", start)
    if walked:
        statistics = 0 if stats is None else stats.nbytes()
        stats = None  # the walk keeps its own, block by block
        blocks, walk = blockwise.walk(
            model, batches, config, device, max_stats_gib, total, progress, world, dist_timeout, timer, plan
        )
        statistics = max(statistics, walk.pop("statistics_bytes"))
        calibration = {"images": walk.pop("images"), "skipped": walk.pop("skipped"), **walk}
    else:
        if stats is None:
            stats = calibrate(model, batches, config, device, total=total, progress=progress, merge=merge)
            timer.add("calibration", start)
        if world.is_main:
            blocks = prune_model(model, stats, config, timer, plan)
        statistics, calibration = stats.nbytes(), {"images": stats.images, "skipped": stats.skipped, "mode": "one-pass"}
    if not world.is_main:
        return None
    report = {
        "config": config.to_dict(),
        "device": device_name(device),
        "calibration": {**calibration, "processes": world.size},
        "seconds": timer.seconds,
        "memory": {"statistics_mib": statistics / 2**20, **peak_memory(device)},
        "dense": dense,
        "pruned": model_size(model),
        "blocks": blocks,
    }
    if allocation is not None:
        report["allocation"] = allocation
    return PruneResult(model, report)


def _hold_out(
    batches: Iterable[tuple[Tensor, int]], n: int, total: int | None
) -> tuple[Tensor, Iterable[tuple[Tensor, int]], int | None]:
    """The sensitivity pass's images, the calibration stream without them, and its new size."""
    if total is not None and total <= n:
        raise CorpError(
            f"--allocation sensitivity holds out the first {n} calibration images (--sensitivity-images) and "
            f"only {total} are given; pass more images or lower --sensitivity-images"
        )
    heldout, rest = split_heldout(batches, n)
    if heldout.shape[0] == 0:
        raise CorpError("no calibration images to hold out for --allocation sensitivity; check the calibration data")
    return heldout, rest, None if total is None else total - heldout.shape[0]


def save(
    result: PruneResult,
    out: str | Path,
    model_name: str,
    model_args: dict | None = None,
    weights: str = "unknown",
    overwrite: bool = False,
) -> Path:
    """Write the artifact folder (``model.safetensors`` + ``corp.json``) atomically."""
    meta = {
        "model": {"name": model_name, "args": model_args or {}, "weights": weights},
        "versions": versions(),
        "report": result.report,
    }
    return save_pruned(result.model, out, meta, overwrite=overwrite)


def load_source(
    source: str | Path,
    weights: str = "pretrained",
    checkpoint: str | Path | None = None,
    model_args: dict | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """A prune artifact folder or a timm model name -> (model in eval mode, ``describe(model)``)."""
    if Path(source, META_FILE).is_file():
        meta = read_meta(source)
        model = load_pruned(source)
        return model, describe(model, meta["model"]["name"], meta["model"].get("args", {}), "corp-pruned")
    model = create_model(str(source), weights=weights, checkpoint=checkpoint, model_args=model_args)
    origin = f"checkpoint:{Path(checkpoint).name}" if checkpoint else weights
    return model, describe(model, resolve_name(str(source)), model_args or {}, origin)


def dense_original(meta: dict[str, Any], checkpoint: str | Path | None = None) -> tuple[nn.Module | None, str]:
    """The dense original of a prune artifact (its ``corp.json``) with real weights: (model, "") or (None, why).

    From ``checkpoint`` if given (then its errors are the caller's), else from what the artifact
    records: the checkpoint it was pruned from (if that file is still there) or timm's pretrained
    weights. Random weights cannot be had again.
    """
    model, weights = meta["model"], meta["model"].get("weights", "")
    recorded = weights.removeprefix("checkpoint:") if weights.startswith("checkpoint:") else None
    path = checkpoint or (recorded if recorded and Path(recorded).is_file() else None)
    try:
        if path:
            return create_model(model["name"], checkpoint=path, model_args=model.get("args", {})), ""
        if weights == "pretrained":
            return create_model(model["name"], weights="pretrained", model_args=model.get("args", {})), ""
    except CorpError as e:
        if checkpoint:
            raise
        return None, str(e)
    return None, "dense weights were random or their checkpoint moved (pass --checkpoint)"


def describe(model: nn.Module, name: str, model_args: dict, weights: str) -> dict[str, Any]:
    """What an exported file needs to say about its model: name, weights, widths, input, preprocessing."""
    cfg = data_config(model)
    return {
        "model": name,
        "model_args": model_args,
        "weights": weights,
        "structure": block_widths(model),
        "input_size": list(cfg["input_size"]),
        "preprocessing": {k: cfg[k] for k in ("mean", "std", "interpolation", "crop_pct") if k in cfg},
        "corp_deploy": __version__,
    }
