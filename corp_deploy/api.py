"""The Python API: everything the CLI does, callable directly.

model = corp_deploy.create_model("deit_small", weights="random")
batches, total = corp_deploy.calibration_batches(model, "photos/", num=256)
result = corp_deploy.prune(model, batches, corp_deploy.PruneConfig(sparsity=0.5), total=total)
corp_deploy.save(result, "runs/deit_small-s50")
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor, nn

from corp_deploy import blockwise, hf
from corp_deploy.allocation import check_budget, error_curves, plan_budget, widths_of
from corp_deploy.artifact import META_FILE, load_pruned, read_meta, save_pruned
from corp_deploy.data import (
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
from corp_deploy.distributed import SINGLE_PROCESS, World, all_reduce_stats, shard
from corp_deploy.env import device_name, exact_fp32, versions
from corp_deploy.errors import CorpError
from corp_deploy.family import adapter_for, structure
from corp_deploy.latency import LatencyTable, Timing
from corp_deploy.models import create_model, resolve_name
from corp_deploy.perplexity import perplexity
from corp_deploy.pruner import (
    Budget,
    PruneConfig,
    Timer,
    Widths,
    calibrate,
    check_parts,
    plan_widths,
    prune_model,
)
from corp_deploy.report import model_size, peak_memory
from corp_deploy.sensitivity import measure, split_heldout
from corp_deploy.stats import CalibrationStats
from corp_deploy.text import (
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
from corp_deploy.version import __version__

T = TypeVar("T")


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
            "--calib synthetic: calibrating on NOISE images. Use only for smoke tests; the pruned "
            "model's accuracy is meaningless. Pass --calib-dir with real images for real use.",
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
    files, held = split(sample(list_images(root), num, seed), hold_out, seed)
    files = shard(files, world)
    workers = min(8, os.cpu_count() or 1) if workers is None else workers
    heldout = None
    if held and world.is_main:
        loaded = [images for images, _ in folder_batches(held, data_config(model), len(held), 0)]
        if not loaded or sum(x.shape[0] for x in loaded) == 0:
            raise CorpError(f"none of the {len(held)} held-out calibration images could be read; check the files")
        heldout = Heldout(torch.cat(loaded), folder_counts(held, root))
    return Calibration(folder_batches(files, data_config(model), batch_size, workers), len(files), heldout)


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
            "--calib synthetic: calibrating on RANDOM TOKENS. Use only for smoke tests; pass --calib-dir with text.",
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
        if ids.shape[0] < num:
            warnings.warn(
                f"{source} holds {ids.shape[0]} calibration sequences of {seq_len} tokens, not {num}", stacklevel=2
            )
        mine = ids[world.rank :: world.size]  # this rank's shard of the packed windows (``distributed.shard``)
        return Calibration(packed_batches(mine, batch_size), mine.shape[0], heldout)
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


ONE_PASS, GROUPED, SEQUENTIAL = "one-pass", "grouped", "sequential"
"""How the statistics are gathered: all blocks in one pass; blocks in groups that fit a memory bound, from a
cached stem pass; block by block over the stream pruned so far (``blockwise``)."""


def calibration_mode(config: PruneConfig, max_stats_gib: float | None, world: World) -> str:
    """The calibration step for ``config``; combinations no step supports are refused here, before any work."""
    if config.depth and world.size > 1:
        raise CorpError("--depth runs in one process so far; drop torchrun or --depth")
    if config.sequential:
        if config.budget is not None and world.size > 1:
            raise CorpError("--budget with --sequential runs in one process; drop torchrun or one of the two")
        return SEQUENTIAL
    if max_stats_gib is None:
        return ONE_PASS
    if needs_statistics(config):
        what = "--budget" if config.budget is not None else "--selection global"
        raise CorpError(f"{what} compares every block's statistics at once; drop --max-stats-gib or {what}")
    return GROUPED


def check_loop(config: PruneConfig, max_stats_gib: float | None, processes: int) -> None:
    """Refuse, before any work, what the closed loop (``LatencyLoop``) cannot re-plan."""
    if config.budget is None or config.budget.kind != "latency":
        raise CorpError("the latency check times a latency budget: pass --speedup S or --budget latency=F")
    if config.sequential or max_stats_gib is not None:
        raise CorpError(
            "the latency check re-allocates from the statistics of one pass; --sequential would re-walk the data "
            "for every plan, so it is refused here: drop --sequential, or use corp-deploy prune (no check)"
        )
    if processes > 1:
        raise CorpError("the latency check times on one machine; run it without torchrun")


def needs_statistics(config: PruneConfig) -> bool:
    """Whether the widths come from the statistics (a budget, a global threshold) rather than the sparsities."""
    return config.budget is not None or config.selection == "global"


def check_widths(
    model: nn.Module, config: PruneConfig, dense_macs: int, table: LatencyTable | None = None
) -> list[Widths] | None:
    """Data-free: refuse what no calibration can fix (bad sparsity, unsupported block, unreachable budget).

    Returns the widths when they do not depend on the data, else None (``plan`` makes them after calibration).
    """
    if config.budget is not None:
        check_parts(model, config)
        check_budget(model, config, dense_macs, table)
        return None
    if config.selection == "global":
        plan_widths(model, replace(config, selection="per-layer"))  # every other width, and the blocks
        return None
    return plan_widths(model, config)


Replan = Callable[..., tuple[list[Widths], dict[str, Any]]]
"""(latency table[, budget]) -> widths and their record, from statistics, error curves and sensitivities computed
once; the budget defaults to the config's."""


def planner(
    model: nn.Module, stats: CalibrationStats, config: PruneConfig, dense_macs: int, heldout: Heldout | None
) -> Replan:
    """A budget's allocation from the statistics (with sensitivities from ``heldout``), re-runnable for corrected
    latency tables (the closed loop) or other budgets (a sweep of speedups) without another pass over the data.
    ``model`` must stay dense."""
    weights = None if heldout is None else measure(model, stats, config, heldout.images)
    curves = error_curves(model, stats, config, config.target)

    def replan(table: LatencyTable | None, budget: Budget | None = None) -> tuple[list[Widths], dict[str, Any]]:
        budgeted = config if budget is None else replace(config, budget=budget)
        widths, record = plan_budget(model, stats, budgeted, dense_macs, weights, curves, table)
        if heldout is not None:
            record["heldout"] = {"images": adapter_for(model).count(heldout.images), "folders": heldout.folders}
        return widths, record

    return replan


def plan(
    model: nn.Module,
    stats: CalibrationStats,
    config: PruneConfig,
    dense_macs: int,
    heldout: Heldout | None,
    table: LatencyTable | None = None,
) -> tuple[list[Widths], dict[str, Any] | None]:
    """Widths from the statistics: a budget's allocation (with sensitivities from ``heldout``), or a threshold.

    Returns the widths and what the report records about how they were chosen.
    """
    if config.budget is None:
        return plan_widths(model, config, stats), None
    return planner(model, stats, config, dense_macs, heldout)(table)


@dataclass(frozen=True)
class LatencyLoop:
    """A latency budget's closed loop: after pruning, ``timing(dense, pruned)`` measures both in one run on the
    table's backend; while the measured speedup misses the target by more than the noise band, the table is
    corrected with the measured point and the widths re-allocated from the same statistics, ``rounds`` at most."""

    timing: Callable[[nn.Module, nn.Module], Timing]
    rounds: int = 3

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise CorpError(f"--latency-rounds must be >= 1, got {self.rounds}")


def close_loop(
    dense: nn.Module,
    model: nn.Module,
    blocks: list[dict],
    stats: CalibrationStats,
    config: PruneConfig,
    replan: Replan,
    table: LatencyTable,
    widths: list[Widths],
    record: dict[str, Any],
    loop: LatencyLoop,
    timer: Timer,
) -> tuple[nn.Module, list[dict], dict[str, Any], dict[str, Any]]:
    """Time, correct, re-plan and re-prune (from a copy of ``dense``) until the speedup is met or rounds run out.

    Returns the pruned model, its block reports, the allocation record and the loop's record for ``corp.json``.
    """
    target = 1 / config.budget.fraction
    history: list[dict[str, Any]] = []
    while True:
        start = time.perf_counter()
        measured = loop.timing(dense, model)
        timer.add("latency check", start)
        history.append(
            {
                "predicted_speedup": record["latency"]["predicted_speedup"],
                "measured_speedup": measured.speedup,
                "spread": measured.band,
                "dense_ms": measured.dense_s * 1e3,
                "pruned_ms": measured.pruned_s * 1e3,
                "widths": [list(widths_of(dense, w)) for w in widths],
            }
        )
        met = abs(measured.speedup / target - 1) <= measured.band
        if met or len(history) == loop.rounds:
            break
        planned = [widths_of(dense, w) for w in widths]
        try:  # a pair no correction follows, or a corrected table that puts the target out of reach: keep this one
            table = table.corrected(measured.dense_s, measured.pruned_s, planned)
            widths, record = replan(table)
        except CorpError as e:
            history[-1]["stopped"] = str(e)
            break
        model = copy.deepcopy(dense)
        blocks = prune_model(model, stats, config, timer, widths)
    last = history[-1]
    return (
        model,
        blocks,
        record,
        {
            "backend": table.key["backend"],
            "batch": table.key["batch"],
            **({"seq_len": table.key["seq_len"]} if "seq_len" in table.key else {}),
            "target_speedup": target,
            "predicted_speedup": last["predicted_speedup"],
            "measured_speedup": last["measured_speedup"],
            "spread": last["spread"],
            "rounds": len(history),
            "met": met,
            "history": history,
        },
    )


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
    heldout: Heldout | None = None,
    table: LatencyTable | None = None,
    loop: LatencyLoop | None = None,
) -> PruneResult | None:
    """Calibrate ``model``, then prune and compensate it in place; measure what changed.

    The steps, each a function of its own inputs: ``check_widths`` (data-free), ``calibration_mode``, the
    statistics (``pruner.calibrate``, or ``blockwise.walk`` which calibrates and prunes block by block),
    ``plan`` (widths from the statistics, when a budget or a global threshold needs them) and
    ``pruner.prune_model``. Data-parallel (``world.size > 1``): the sums are merged over all ranks, rank 0
    plans and prunes and gets the result; the other ranks get ``None``.

    A budget with ``allocation="sensitivity"`` needs ``config.sensitivity_images`` held-out images:
    ``calibration_data(..., hold_out=n)`` draws them across the whole sample; without ``heldout`` they are
    cut from the start of ``batches`` (which is biased when the stream is in class order).

    A ``latency=`` budget is predicted with ``table`` (``corp_deploy.speed.table_for`` measures one); with
    ``loop`` the pruned model is timed against the dense one and re-planned while it misses (``close_loop``).
    """
    config = config or PruneConfig()
    if loop is not None:
        check_loop(config, max_stats_gib, world.size)
        if table is None:
            raise CorpError("the closed loop corrects a latency table: pass the table the budget was planned with")
    device = resolve_device(device) if isinstance(device, str) else device
    mode = calibration_mode(config, max_stats_gib, world)
    dense = model_size(model)
    widths = check_widths(model, config, dense["macs"], table)
    if mode != ONE_PASS:  # a bound below one block fails here
        blockwise.plan_groups(model, config, max_stats_gib)
    if config.heldout_images and heldout is None and world.is_main:
        if adapter_for(model).unit != "images":
            raise CorpError(
                "--allocation sensitivity on a text model needs held-out sequences: pass the heldout of "
                "text_calibration_data(..., hold_out=n), or use --allocation local"
            )
        heldout, batches, total = _hold_out(batches, config.heldout_images, total)
    model.to(device).eval()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = Timer()
    merge = None if world.size == 1 else lambda st: all_reduce_stats(st, world, dist_timeout)
    stats, record, replan = None, None, None
    if widths is None:  # the widths come from the statistics: gather them first
        if mode == SEQUENTIAL:
            batches = list(batches)  # read twice: once for the widths, once by the walk
        start = time.perf_counter()
        stats = calibrate(model, batches, config, device, total=total, progress=progress, merge=merge)
        start = timer.add("calibration", start)
        if world.is_main and config.budget is not None:
            dense_model = copy.deepcopy(model) if loop is not None else model  # re-plans need it dense
            with exact_fp32():  # the sensitivity pass's forwards
                replan = planner(dense_model, stats, config, dense["macs"], heldout)
            widths, record = replan(table)
        elif world.is_main:
            widths, record = plan(model, stats, config, dense["macs"], heldout)
        if world.is_main:
            timer.add("allocation", start)
    if mode == ONE_PASS:
        if stats is None:
            start = time.perf_counter()
            stats = calibrate(model, batches, config, device, total=total, progress=progress, merge=merge)
            timer.add("calibration", start)
        blocks = prune_model(model, stats, config, timer, widths) if world.is_main else []
        if loop is not None:
            model, blocks, record, checked = close_loop(
                dense_model, model, blocks, stats, config, replan, table, widths, record, loop, timer
            )
        statistics, calibration = stats.nbytes(), {"images": stats.images, "skipped": stats.skipped, "mode": mode}
    else:
        statistics = 0 if stats is None else stats.nbytes()
        stats = None  # the walk keeps its own, block by block
        with exact_fp32():  # the walk calibrates as it goes (see pruner.calibrate)
            blocks, walk = blockwise.walk(
                model, batches, config, device, max_stats_gib, total, progress, world, dist_timeout, timer, widths
            )
        statistics = max(statistics, walk.pop("statistics_bytes"))
        calibration = {"images": walk.pop("images"), "skipped": walk.pop("skipped"), **walk}
    if not world.is_main:
        return None
    adapter = adapter_for(model)
    calibration = {adapter.unit: calibration.pop("images"), "unit": adapter.unit, **calibration}  # text: sequences
    report = {
        "config": config.to_dict(),
        "mlp_out": adapter.mlp_out_name,
        "device": device_name(device),
        "calibration": {**calibration, "processes": world.size},
        "seconds": timer.seconds,
        "memory": {"statistics_mib": statistics / 2**20, **peak_memory(device)},
        "dense": dense,
        "pruned": model_size(model),
        "blocks": blocks,
    }
    if record is not None:
        report["allocation"] = record
    if loop is not None:
        report["latency"] = checked
    return PruneResult(model, report)


def _hold_out(
    batches: Iterable[tuple[Tensor, int]], n: int, total: int | None
) -> tuple[Heldout, Iterable[tuple[Tensor, int]], int | None]:
    """The first ``n`` images of the stream (no ``heldout`` given), the stream without them, and its new size."""
    if total is not None and total <= n:
        raise CorpError(
            f"--allocation sensitivity holds out {n} calibration images (--sensitivity-images) and "
            f"only {total} are given; pass more images or lower --sensitivity-images"
        )
    images, rest = split_heldout(batches, n)
    if images.shape[0] == 0:
        raise CorpError("no calibration images to hold out for --allocation sensitivity; check the calibration data")
    return Heldout(images, {"first images of the stream": images.shape[0]}), rest, total and total - images.shape[0]


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
    seq_len: int = hf.MACS_SEQ_LEN,
) -> tuple[nn.Module, dict[str, Any]]:
    """A prune artifact folder, a ``transformers`` encoder (a folder with a config.json, or ``hf:NAME``) or a
    timm model name -> (model in eval mode, ``describe(model)``); text descriptions are for ``seq_len`` tokens."""
    if Path(source, META_FILE).is_file():
        meta = read_meta(source)
        model = load_pruned(source)
        return model, describe(model, meta["model"]["name"], meta["model"].get("args", {}), "corp-pruned", seq_len)
    if hf.is_source(str(source)):
        if checkpoint is not None or model_args:
            raise CorpError("--checkpoint and --model-arg are for timm models; a transformers folder holds its weights")
        model, _ = hf.load(str(source))
        return model, describe(model, str(source), {}, "pretrained", seq_len)
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


def describe(
    model: nn.Module, name: str, model_args: dict, weights: str, seq_len: int = hf.MACS_SEQ_LEN
) -> dict[str, Any]:
    """What an exported file needs to say about its model: name, weights, widths, input, preprocessing.

    A text model's inputs are token ids and a mask of dynamic batch and sequence: it records their names,
    the sequence length it is meant for (``seq_len``: engine profiles, bench) and the range the positions allow.
    """
    if isinstance(adapter_for(model), hf.HfText):
        check_seq_len(seq_len, model.config)
        return {
            "modality": "text",
            "model": name,
            "model_args": model_args,
            "weights": weights,
            "structure": structure(model),
            "inputs": ["input_ids", "attention_mask"],
            "seq_len": seq_len,
            "max_positions": hf.max_positions(model.config),
            "vocab_size": model.config.vocab_size,
            "corp_deploy": __version__,
        }
    cfg = data_config(model)
    return {
        "model": name,
        "model_args": model_args,
        "weights": weights,
        "structure": structure(model),
        "input_size": list(cfg["input_size"]),
        "preprocessing": {k: cfg[k] for k in ("mean", "std", "interpolation", "crop_pct") if k in cfg},
        "corp_deploy": __version__,
    }


def text_model(source: str | Path) -> tuple[nn.Module, Any]:
    """A ``transformers`` model (eval mode) and its tokenizer from a prune artifact, a local folder or ``hf:NAME``."""
    if Path(source, META_FILE).is_file():
        model = load_pruned(source)
        return model, hf.load_tokenizer(source, model.config.vocab_size)
    return hf.load(str(source))


def text_perplexity(
    model: nn.Module,
    tokenizer: Any,
    text: str | Path,
    seq_len: int,
    batch_size: int = 1,
    device: torch.device | str = "cpu",
    all_text: bool = False,
    max_windows: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """A decoder's perplexity (``perplexity``: SparseGPT's protocol) on the evaluation documents of a text folder
    (``text.split_documents``: never a calibration document of the same folder), or on all of it (``all_text``,
    for a test set that calibration never saw), over the first ``max_windows`` windows when given.
    Returns the number and what it was measured on."""
    if not adapter_for(model).causal:
        raise CorpError(f"perplexity needs a decoder (a causal LM); {type(model).__name__} is an encoder")
    if tokenizer is None:
        raise CorpError("perplexity needs the model's tokenizer, and its folder has none")
    check_seq_len(seq_len, model.config)
    docs = read_documents(text)
    chosen = docs if all_text else split_documents(docs).evaluation
    if not chosen:
        raise CorpError(
            f"{text} holds {len(docs)} documents, too few to keep an evaluation part apart from calibration; "
            "pass --all-text if calibration never read this folder"
        )
    part = "all" if all_text else "evaluation"
    windows = packed_sequences(tokenizer, chosen, seq_len, part=part)
    of_windows, windows = windows.shape[0], windows[:max_windows]
    value = perplexity(model.to(device), windows, batch_size, device, progress)
    return {
        "perplexity": value,
        "windows": windows.shape[0],
        "of_windows": of_windows,
        "seq_len": seq_len,
        "documents": len(chosen),
        "of_documents": len(docs),
        "part": part,
        "text": str(text),
    }


def heldout_windows(tokenizer: Any, source: str | Path, vocab: int, seq_len: int, num: int, seed: int = 0) -> Tensor:
    """(``num``, ``seq_len``) token ids that verify a quantized decoder: packed windows of a text folder's held-out
    documents (``text.split_documents``: never calibration or evaluation text), or random tokens below ``vocab``
    for ``source == "synthetic"`` (structure only: a random stream says nothing about quantization error)."""
    if num < 1 or seq_len < 2:
        raise CorpError(f"verification needs >= 1 window of >= 2 tokens, got {num} x {seq_len}")
    if str(source) == SYNTHETIC:
        g = torch.Generator().manual_seed(seed + HELDOUT_SEED_OFFSET)
        return torch.randint(0, vocab, (num, seq_len), generator=g)
    if tokenizer is None:
        raise CorpError(f"{source}: decoder verification needs the model's tokenizer, and its folder has none")
    parts = split_documents(read_documents(source))
    return packed_sequences(tokenizer, shuffled(parts.heldout, seed), seq_len, num, "held-out")


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
