"""Pruning, end to end: the target a model's family takes by default (``for_model``), the one check of a config
against the model before any data is read (``check``), a latency budget's closed loop (``plan.loop``; its
table: ``plan.speed.latency_table``), the calibration, the width plan (``plan.width_plan``: a sparsity, a budget, a
measured latency through the closed loop), ``pruner.prune_model`` and the report, and ``save``. What calibration
reads is ``calibration``; what a command was pointed at, ``sources``.

model = corp_deploy.create_model("deit_small", weights="random")
batches, total = corp_deploy.calibration_batches(model, "photos/", num=256)
result = corp_deploy.prune(model, batches, corp_deploy.PruneConfig(sparsity=0.5), total=total)
corp_deploy.save(result, "runs/deit_small-s50")

Calibrate once, prune many (``model`` stays dense; each result is a pruned copy with the same report):

calib = corp_deploy.calibrated(model, batches, corp_deploy.PruneConfig(target="mlp,qk,v"), total=total)
results = [calib.prune(corp_deploy.PruneConfig(sparsity=s, target="mlp,qk,v")) for s in (0.3, 0.5)]

A latency budget, as ``corp-deploy prune --speedup 2 --latency-on ort-cpu-fp32 --latency-rounds 3`` plans it
(``from corp_deploy.bench import meter``; ``from corp_deploy.plan import loop, speed``):

on = speed.Latency(meter.check_backend("ort-cpu-fp32"), batch=32, rounds=3)
config = corp_deploy.PruneConfig(budget="latency=0.5")  # prunes mlp,qk,v, as far as the family can
table = speed.latency_table(model, "deit_small", {}, on)
result = corp_deploy.prune(model, batches, config, total=total, table=table, loop=loop.latency_loop(on))

Label-free recovery after pruning (opt-in; ``corp_deploy.core.recover``): keep a dense copy, and the calibration batches
recovery trains on as ``prune`` reads them (``recover.Kept``), then ``recover_pruned``:

dense, kept = copy.deepcopy(model), recover.Kept(batches, adapter_for(model).count)
result = corp_deploy.prune(model, kept, corp_deploy.PruneConfig(sparsity=0.5), total=total)
api.recover_pruned(result, dense, kept.batches, recover.Recovery(steps=30))  # result.report["recovery"]
"""

from __future__ import annotations

import copy
import functools
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy.base import memory
from corp_deploy.base.env import device_name, exact_fp32, versions
from corp_deploy.base.errors import CorpError
from corp_deploy.core import blockwise
from corp_deploy.core.config import PruneConfig, Widths
from corp_deploy.core.distributed import SINGLE_PROCESS, World, all_reduce_stats
from corp_deploy.core.pruner import Timer, calibrate, prune_model
from corp_deploy.core.recover import Interrupted, Recovery, RecoveryRecord
from corp_deploy.core.stats import CalibrationStats
from corp_deploy.families import adapter_for, onload
from corp_deploy.formats.artifact import save_pruned
from corp_deploy.formats.calibration import Heldout, resolve_device
from corp_deploy.plan import width_plan
from corp_deploy.plan.latency import LatencyTable
from corp_deploy.plan.loop import LatencyLoop, check_loop, close_loop
from corp_deploy.plan.report import model_size, peak_memory
from corp_deploy.plan.sensitivity import hold_out
from corp_deploy.plan.width_plan import Replan


@dataclass
class PruneResult:
    """The pruned model (in place of the dense one) and the report that goes into ``corp.json``."""

    model: nn.Module
    report: dict[str, Any]


ONE_PASS, GROUPED, SEQUENTIAL = "one-pass", "grouped", "sequential"
"""How the statistics are gathered: all blocks in one pass; blocks in groups that fit a memory bound, from a
cached stem pass; block by block over the stream pruned so far (``blockwise``)."""


def for_model(config: PruneConfig, model: nn.Module) -> PruneConfig:
    """``config`` with a target it did not choose narrowed to the parts ``model``'s family prunes (in the layout asked
    for): Llama, Mistral and Qwen2 prune no Q/K under RoPE. A chosen target stands as it is: ``check`` refuses a part
    the family cannot prune."""
    if config.chose_target:
        return config
    adapter = adapter_for(model)
    parts = adapter.standard_parts if config.layout == "standard" and adapter.standard_parts else adapter.parts
    return replace(config, target=[p for p in config.target if p in parts])


def check(
    model: nn.Module,
    config: PruneConfig,
    dense_macs: int,
    max_stats_gib: float | None = None,
    world: World = SINGLE_PROCESS,
    table: LatencyTable | None = None,
    loop: LatencyLoop | None = None,
) -> tuple[str, list[Widths] | None]:
    """The one check of ``config`` against ``model`` and the run, before any data is read (``config`` alone was
    checked when it was made): the calibration step and what none supports, the closed loop's needs, the widths
    (``plan.width_plan.data_free``: the blocks, the sparsities, a budget's reach), a statistics bound below one block.

    Returns the calibration step (``ONE_PASS``, ``GROUPED``, ``SEQUENTIAL``) and the widths when they do not wait
    for the statistics (else None: ``plan.width_plan.plan`` makes them after calibration).
    """
    mode = calibration_mode(config, max_stats_gib, world.size)
    if loop is not None:
        check_loop(config, max_stats_gib, world.size, table)
    widths = width_plan.data_free(model, config, dense_macs, table)
    if mode != ONE_PASS:
        blockwise.plan_groups(model, config, max_stats_gib)
    return mode, widths


def calibration_mode(config: PruneConfig, max_stats_gib: float | None, processes: int = 1) -> str:
    """The calibration step for ``config`` in a job of ``processes``; combinations no step supports are refused.
    It needs no model, so a command line can be refused before its model and data load (``cli.prune``)."""
    if config.depth and processes > 1:
        raise CorpError("--depth runs in one process so far; drop torchrun or --depth")
    if config.sequential:
        if config.budget is not None and processes > 1:
            raise CorpError("--budget with --sequential runs in one process; drop torchrun or one of the two")
        return SEQUENTIAL
    if max_stats_gib is None:
        return ONE_PASS
    if width_plan.from_statistics(config):
        what = "--budget" if config.budget is not None else f"--selection {config.selection}"
        raise CorpError(f"{what} compares every block's statistics at once; drop --max-stats-gib or {what}")
    return GROUPED


@dataclass
class Calibrated:
    """One calibration pass over a dense model, pruned any number of ways.

    ``calibrated(model, batches, config)`` reads the data once; every ``prune(config)`` prunes a copy of ``dense``
    from the same statistics and returns what ``prune`` returns (the same report shape): a sweep of sparsities or
    speed targets, the demo's three compensations, a study's methods. Configs that differ only in their budget share
    one planner (error curves and sensitivities computed once). ``prune`` never prunes ``dense``.

    ``dense`` stays on the calibration device, and every result is made there: on a GPU, move ``dense`` (and the
    results you keep) to the CPU between prunes when memory is short; a pruned copy goes where ``device`` says.
    """

    dense: nn.Module
    stats: CalibrationStats
    config: PruneConfig
    """What the statistics were gathered for: a config may prune only its parts (and replace its ``depth``)."""
    device: torch.device
    heldout: Heldout | None = None
    seconds: float = 0.0
    """The calibration pass's wall time, charged to every result's ``seconds``."""
    progress: bool = True
    """A bar over the blocks while they are compensated."""
    _planners: dict[tuple, Replan] = field(default_factory=dict, repr=False)

    def prune(
        self,
        config: PruneConfig | None = None,
        table: LatencyTable | None = None,
        loop: LatencyLoop | None = None,
        widths: list[Widths] | None = None,
    ) -> PruneResult:
        """A pruned copy of ``dense`` and its report; ``table``/``loop`` as for ``prune``; ``widths`` given (a study's
        own plan, no closed loop) are used as they are."""
        config = for_model(config or self.config, self.dense)
        if widths is None:
            widths = self.check(config, self.dense_size["macs"], table, loop)
        elif loop is not None:
            raise CorpError("the closed loop re-plans the widths: pass widths or a loop, not both")
        return self._prune(copy.deepcopy(self.dense), config, self.dense_size, table, loop, widths)

    @functools.cached_property
    def dense_size(self) -> dict[str, Any]:
        """``model_size`` of ``dense`` (a traced forward), measured once."""
        return model_size(self.dense)

    def check(
        self, config: PruneConfig, dense_macs: int, table: LatencyTable | None, loop: LatencyLoop | None
    ) -> list[Widths] | None:
        """That the statistics hold every part ``config`` prunes, then ``check`` (one pass, one process)."""
        for part, have in (("mlp", self.stats.mlp), ("qk", self.stats.qk), ("v", self.stats.proj)):
            if config.prunes(part) and not have:
                raise CorpError(f"this calibration did not gather {part} statistics: calibrate with that target")
        if set(config.depth) - set(self.config.depth):
            raise CorpError("this calibration did not gather --depth statistics for every module asked")
        if config.heldout_images and self.heldout is None:
            raise CorpError("--allocation sensitivity needs held-out inputs: calibrate with heldout, or use local")
        if config.sequential:
            raise CorpError("--sequential calibrates block by block over the pruned stream: use prune, not calibrated")
        return check(self.dense, config, dense_macs, table=table, loop=loop)[1]

    def planner(self, config: PruneConfig, dense_macs: int) -> Replan:
        """``config``'s planner with its budget, made once per config up to the budget (``plan.width_plan.planner``)."""
        key = tuple((f.name, getattr(config, f.name)) for f in fields(config) if f.name != "budget")
        key += (None if config.budget is None else config.budget.kind,)
        if key not in self._planners:
            with exact_fp32():  # the sensitivity pass's forwards
                self._planners[key] = width_plan.planner(self.dense, self.stats, config, dense_macs, self.heldout)
        return functools.partial(self._planners[key], budget=config.budget)

    def _prune(
        self,
        model: nn.Module,
        config: PruneConfig,
        dense_size: dict[str, Any],
        table: LatencyTable | None,
        loop: LatencyLoop | None,
        widths: list[Widths] | None,
        timer: Timer | None = None,
    ) -> PruneResult:
        """Prune ``model`` (``dense`` itself or a copy of it) in place: plan, ``prune_model``, the closed loop."""
        timer = timer or Timer({"calibration": self.seconds})
        model.to(self.device).eval()
        record = checked = replan = None
        if widths is None or loop is not None:
            start = time.perf_counter()
            replan = self.planner(config, dense_size["macs"])
            if widths is None:
                widths, record = replan(table)
            timer.add("allocation", start)
        blocks = prune_model(model, self.stats, config, widths, timer, self.progress)
        if loop is not None:
            model, blocks, record, checked = close_loop(
                self.dense, model, blocks, self.stats, config, replan, table, widths, record, loop, timer
            )
        calibration = {"samples": self.stats.samples, "skipped": self.stats.skipped, "mode": ONE_PASS}
        return PruneResult(
            model,
            _report(
                model, config, self.device, calibration, timer, self.stats.nbytes(), dense_size, blocks, record, checked
            ),
        )


def calibrated(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, int]],
    config: PruneConfig | None = None,
    device: str | torch.device = "auto",
    total: int | None = None,
    progress: bool = True,
    heldout: Heldout | None = None,
) -> Calibrated:
    """Gather ``config``'s statistics (every part it targets, its ``depth``) from ``batches`` in one pass over
    ``model``, which stays dense, for any number of ``Calibrated.prune`` calls. A budget with
    ``allocation="sensitivity"`` needs ``heldout`` (``calibration_data(..., hold_out=n)``)."""
    config = for_model(config or PruneConfig(), model)
    device = resolve_device(device) if isinstance(device, str) else device
    if config.heldout_images and heldout is None:  # before the pass, not at the first prune
        raise CorpError("--allocation sensitivity needs held-out inputs: pass heldout, or use --allocation local")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    stats = calibrate(model.to(device).eval(), batches, config, device, total=total, progress=progress)
    seconds = Timer().add("calibration", start) - start
    return Calibrated(model, stats, config, device, heldout, seconds, progress=progress)


def _report(
    model: nn.Module,
    config: PruneConfig,
    device: torch.device,
    calibration: dict[str, Any],
    timer: Timer,
    statistics_bytes: int,
    dense_size: dict[str, Any],
    blocks: list[dict],
    allocation: dict[str, Any] | None,
    latency: dict[str, Any] | None,
    processes: int = 1,
) -> dict[str, Any]:
    """What ``corp.json`` records of one pruning (``calibration`` counts ``images``: text models count sequences)."""
    adapter = adapter_for(model)
    calibration = {adapter.unit: calibration.pop("samples"), "unit": adapter.unit, **calibration}
    with onload.streamed(model):  # an onloaded result: its pruned blocks read one at a time, as the dense ones were
        pruned = model_size(model)
    report = {
        "config": config.to_dict(),
        "mlp_out": adapter.mlp_out_name,
        "device": device_name(device),
        "calibration": {**calibration, "processes": processes},
        "seconds": timer.seconds,
        "memory": {"statistics_mib": statistics_bytes / 2**20, **peak_memory(device)},
        "dense": dense_size,
        "pruned": pruned,
        "blocks": blocks,
    }
    if allocation is not None:
        report["allocation"] = allocation
    if latency is not None:
        report["latency"] = latency
    return report


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

    The steps, each a function of its own inputs: ``check`` (data-free: the calibration step, the widths when they
    do not wait for the data), the statistics (``pruner.calibrate``, or ``blockwise.walk`` which calibrates and
    prunes block by block), and for one pass ``Calibrated`` (widths from the statistics when a budget or a scored
    selection needs them, ``pruner.prune_model``, the closed loop). A ``config`` whose target was not chosen prunes
    what the model's family can (``for_model``). Data-parallel (``world.size > 1``): the sums are merged over all
    ranks, rank 0 plans and prunes and gets the result; the other ranks get ``None``. To prune one calibration
    several ways, use ``calibrated`` instead.

    A budget with ``allocation="sensitivity"`` needs ``config.sensitivity_images`` held-out images:
    ``calibration_data(..., hold_out=n)`` draws them across the whole sample; without ``heldout`` they are
    cut from the start of ``batches`` (which is biased when the stream is in class order).

    An onloaded ``model`` (``hub.load(..., onload=True)``: its blocks' weights on disk, ``families.onload``) is pruned
    by the walk with one block in memory at a time, the same result as one pass; a budget, a scored selection or
    the closed loop compare every block at once, so for them it is read whole first (the memory plan counts it).
    The walk's result stays onloaded: its pruned blocks wait in the onloader's store, the report measures it
    streamed and ``save`` writes it from there, one tensor at a time; ``onload.restore(result.model)`` reads it
    whole, ``load_pruned`` reads the saved artifact.

    A ``latency=`` budget is predicted with ``table`` (``corp_deploy.plan.speed.table_for`` measures one); with
    ``loop`` the pruned model is timed against the dense one and re-planned while it misses (``close_loop``).
    """
    config = for_model(config or PruneConfig(), model)
    device = resolve_device(device) if isinstance(device, str) else device
    with onload.streamed(model):
        dense = model_size(model)
    mode, widths = check(model, config, dense["macs"], max_stats_gib, world, table, loop)
    whole = onload.of(model) is not None and (widths is None or loop is not None)  # every block's statistics at once
    if onload.of(model) is not None and not whole and mode == ONE_PASS:  # the same result, one block at a time
        mode = GROUPED
    if config.heldout_images and heldout is None and world.is_main:
        if adapter_for(model).modality == "text":
            raise CorpError(
                "--allocation sensitivity on a text model needs held-out sequences: pass the heldout of "
                "text_calibration_data(..., hold_out=n), or use --allocation local"
            )
        heldout, batches, total = hold_out(batches, config.heldout_images, total)
    batches, plan, bound = _memory_plan(model, config, batches, total, device, max_stats_gib, loop is not None)
    if whole:  # read after the plan, which counts it: a model the machine cannot hold is refused unread
        onload.restore(model)
    if bound is not None and mode == ONE_PASS:  # one pass does not fit: the same result, block group by group
        mode, max_stats_gib = GROUPED, bound
    if onload.of(model) is None:
        model.to(device)
    else:
        onload.of(model).to(device)
    model.eval()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = Timer()
    merge = None if world.size == 1 else lambda st: all_reduce_stats(st, world, dist_timeout)
    if mode == SEQUENTIAL and widths is None:
        batches = list(batches)  # read twice: once for the widths, once by the walk
    stats, record = None, None
    if mode == ONE_PASS or widths is None:
        start = time.perf_counter()
        stats = calibrate(model, batches, config, device, total=total, progress=progress, merge=merge)
        timer.add("calibration", start)
    if mode == ONE_PASS:
        if not world.is_main:
            return None
        dense_model = copy.deepcopy(model) if loop is not None else model  # the loop re-prunes from it
        result = Calibrated(dense_model, stats, config, device, heldout, progress=progress)._prune(
            model, config, dense, table, loop, widths, timer
        )
        result.report["calibration"]["processes"] = world.size
        result.report["memory"]["plan"] = plan.to_dict()
        return result
    statistics = 0
    if stats is not None:  # sequential with widths from the statistics: plan them from this pass
        start = time.perf_counter()  # on every rank: the merged sums give every rank the same widths
        with exact_fp32():  # the sensitivity pass's forwards
            widths, record = width_plan.plan(model, stats, config, dense["macs"], heldout, table)
        timer.add("allocation", start)
        statistics, stats = stats.nbytes(), None  # the walk keeps its own, block by block
    with exact_fp32():  # the walk calibrates as it goes (see pruner.calibrate)
        blocks, walk = blockwise.walk(
            model, batches, config, widths, device, max_stats_gib, total, progress, world, dist_timeout, timer
        )
    if not world.is_main:
        return None
    statistics = max(statistics, walk.pop("statistics_bytes"))
    calibration = {"samples": walk.pop("samples"), "skipped": walk.pop("skipped"), **walk}
    report = _report(model, config, device, calibration, timer, statistics, dense, blocks, record, None, world.size)
    report["memory"]["plan"] = plan.to_dict()
    return PruneResult(model, report)


def _memory_plan(
    model: nn.Module,
    config: PruneConfig,
    batches: Iterable[tuple[Any, int]],
    total: int | None,
    device: torch.device,
    max_stats_gib: float | None,
    closed_loop: bool,
) -> tuple[Iterable[tuple[Any, int]], memory.Plan, float | None]:
    """``blockwise.memory_plan`` sized from the first calibration batch (put back in front of the rest): the batches,
    the plan, and the statistics bound to run with (None: one pass)."""
    stream = iter(batches)
    first = next(stream, None)
    if first is None:
        return [], memory.Plan({}, None), max_stats_gib
    inputs = first[0]
    n = adapter_for(model).count(inputs)
    if isinstance(inputs, dict):
        tokens = inputs["input_ids"].shape[-1]
    else:  # images: the patch grid of the model's patch embedding (+ a class token), 1 when it has none
        tokens = 1 + max(
            (m.num_patches for m in model.modules() if isinstance(getattr(m, "num_patches", None), int)), default=0
        )
    one_pass = width_plan.from_statistics(config) or closed_loop
    plan, bound = blockwise.memory_plan(model, config, total or n, tokens, n, device, max_stats_gib, one_pass)
    return itertools.chain([first], stream), plan, bound


def recover_pruned(
    result: PruneResult,
    dense: nn.Module,
    batches: Iterable[Any],
    recovery: Recovery,
    heldout: Heldout | None = None,
    say: Callable[[str], None] | None = None,
) -> RecoveryRecord:
    """Train ``result.model`` towards ``dense`` (its copy from before pruning) on ``batches`` (calibration
    batches: ``recover.Kept`` keeps them from the stream ``prune`` reads) on the device it was pruned on, and record
    it in ``result.report``: ``recovery`` (``RecoveryRecord.to_dict``), its seconds, the peak memory since.

    ``heldout`` (the sensitivity pass's held-out inputs) is only evaluated, before and after, never trained on.
    Recovery changes weight values, never a width: after a latency budget's closed loop the measured speed stands.
    ``dense`` is moved to that device for the recovery and back after.
    """
    device, home = next(result.model.parameters()).device, next(dense.parameters()).device
    dense.to(device)
    try:
        record = recovery.run(result.model, dense, batches, None if heldout is None else [heldout.images], say)
    except Interrupted as e:  # the model holds CORP's weights again; its report says the recovery did not finish
        result.report["recovery_interrupted"] = {"steps": e.steps, "budget": e.budget, "kept": "corp"}
        raise
    finally:
        dense.to(home)
    result.report["recovery"] = record.to_dict()
    result.report["seconds"]["recovery"] = record.seconds
    result.report["memory"] |= peak_memory(device)
    return record


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
